// The forward's band masks (csrc/block_lists.cuh: key_band, columns_below, column_mask) on
// the host, for tests/test_band_masks.py. Reads commands from stdin, one per line:
//   M lo hi cols            -> column_mask(lo, hi, cols), unsigned
//   B R j s0 l0 s1 l1       -> visible_interval((s0, l0), (s1, l1), R) and, where it holds,
//                              key_band of key j: "ok start length a b", else "no"
#include <cstdio>

#include "block_lists.cuh"

int main() {
  char cmd;
  while (std::scanf(" %c", &cmd) == 1) {
    if (cmd == 'M') {
      int lo, hi, cols;
      if (std::scanf("%d %d %d", &lo, &hi, &cols) != 3) return 1;
      std::printf("%u\n", flexsparse::column_mask(lo, hi, cols));
    } else if (cmd == 'B') {
      int R, j, s0, l0, s1, l1;
      if (std::scanf("%d %d %d %d %d %d", &R, &j, &s0, &l0, &s1, &l1) != 6) return 1;
      int2 v;
      if (flexsparse::visible_interval(make_int2(s0, l0), make_int2(s1, l1), R, v)) {
        const int2 band = flexsparse::key_band(v, j, R);
        std::printf("ok %d %d %d %d\n", v.x, v.y, band.x, band.y);
      } else {
        std::printf("no\n");
      }
    } else {
      return 1;
    }
  }
  return 0;
}
