// The forward's band masks (csrc/block_lists.cuh: columns_below, column_mask) on the host,
// for tests/test_band_masks.py. Reads commands from stdin, one per line:
//   M lo hi cols            -> column_mask(lo, hi, cols), unsigned
#include <cstdio>

#include "block_lists.cuh"

int main() {
  char cmd;
  while (std::scanf(" %c", &cmd) == 1) {
    if (cmd != 'M') return 1;
    int lo, hi, cols;
    if (std::scanf("%d %d %d", &lo, &hi, &cols) != 3) return 1;
    std::printf("%u\n", flexsparse::column_mask(lo, hi, cols));
  }
  return 0;
}
