// A stand-in for <cuda_runtime.h> so that csrc's device-side list readers
// (csrc/block_lists.cuh) compile as host C++ for tests/test_tile_cursor.py: the qualifiers
// vanish and __ldg is a plain load. Only what block_lists.cuh uses.
#pragma once
#include <algorithm>
#define __device__
#define __forceinline__ inline
template <class T> inline T __ldg(const T* p) { return *p; }
using std::max;
using std::min;
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
