// Walks block lists with the kernels' TileCursor (csrc/block_lists.cuh) on the host, for
// tests/test_tile_cursor.py. Reads from stdin: sub, n_blocks, then per list (partial,
// full): count, ranges (0: explicit), width, and width index entries; prints each tile as
// "tile partial", one per line, then "end"; then the same walk as the forward's consumers
// take it (the cursors started elsewhere and copied, the full one passed as next()'s
// full_started: fwd_sm90.cuh's SharedStorage::cursor), then "end" again.
#include <cstdio>
#include <vector>

#include "block_lists.cuh"

int main() {
  int sub, n_blocks;
  if (std::scanf("%d %d", &sub, &n_blocks) != 2) return 1;
  flexsparse::BlockListParams lists[2];
  std::vector<int32_t> counts(2), index[2];
  for (int l = 0; l < 2; ++l) {
    int ranges, width;
    if (std::scanf("%d %d %d", &counts[l], &ranges, &width) != 3) return 1;
    index[l].resize(width > 0 ? width : 1);
    for (int k = 0; k < width; ++k)
      if (std::scanf("%d", &index[l][k]) != 1) return 1;
    lists[l].count = &counts[l];
    lists[l].index = index[l].data();
    lists[l].ranges = ranges;
    lists[l].width = width;
    lists[l].n_blocks = n_blocks;
  }
  flexsparse::TileCursor walk(lists[0], 0, 0, 0);
  int t;
  bool partial;
  while (walk.next(lists[1], 0, 0, 0, sub, t, partial)) std::printf("%d %d\n", t, int(partial));
  std::printf("end\n");
  // The hand-off: the producer's started cursors (as it stores them before its own walk),
  // copied by value, the full one read only where the walk turns to the full lists.
  const flexsparse::TileCursor started[2] = {flexsparse::TileCursor(lists[0], 0, 0, 0),
                                             flexsparse::TileCursor(lists[1], 0, 0, 0)};
  flexsparse::TileCursor copy = started[0];
  while (copy.next(lists[1], 0, 0, 0, sub, t, partial, &started[1])) std::printf("%d %d\n", t, int(partial));
  std::printf("end\n");
  return 0;
}
