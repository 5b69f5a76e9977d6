// The band masks (csrc/block_lists.cuh: window_band, both passes' band; columns_below and
// column_mask, the forward's; band_rows, the backward's) on the host, for
// tests/test_band_masks.py. Reads commands from stdin, one per line:
//   W left right Lq Lk      -> window_band of the window (left, right) as "a b"
//   M lo hi cols            -> column_mask(lo, hi, cols), unsigned
//   R j a b rows            -> band_rows(j, a, b, rows) as "start length"
#include <cstdio>

#include "block_lists.cuh"

int main() {
  char cmd;
  while (std::scanf(" %c", &cmd) == 1) {
    if (cmd == 'W') {
      int window[2], Lq, Lk;
      if (std::scanf("%d %d %d %d", &window[0], &window[1], &Lq, &Lk) != 4) return 1;
      const int2 ab = flexsparse::window_band(window, Lq, Lk);
      std::printf("%d %d\n", ab.x, ab.y);
      continue;
    }
    if (cmd == 'R') {
      int j, a, b, rows;
      if (std::scanf("%d %d %d %d", &j, &a, &b, &rows) != 4) return 1;
      const int2 v = flexsparse::band_rows(j, a, b, rows);
      std::printf("%d %d\n", v.x, v.y);
      continue;
    }
    if (cmd != 'M') return 1;
    int lo, hi, cols;
    if (std::scanf("%d %d %d", &lo, &hi, &cols) != 3) return 1;
    std::printf("%u\n", flexsparse::column_mask(lo, hi, cols));
  }
  return 0;
}
