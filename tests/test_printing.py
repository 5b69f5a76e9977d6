"""How masks and descriptors print (expecttest: run with EXPECTTEST_ACCEPT=1 to update)."""
import torch
from expecttest import TestCase

from flexsparse import masks as M


class TestPrinting(TestCase):
    def test_mask_repr(self):
        mask = M.or_(M.and_(M.causal(), M.sliding_window(3)), M.prefix_lm(2))
        self.assertExpectedInline(repr(mask), """or_(and_(causal(), sliding_window(left=3, right=0)), prefix_lm(2))""")
        self.assertExpectedInline(repr(M.document([3, 5], causal=False)), """document(lengths=[3, 5], causal=False)""")
        self.assertExpectedInline(repr(M.dense(torch.ones(1, 1, 4, 4, dtype=torch.bool))), """dense(<bool (1, 1, 4, 4)>)""")

    def test_show_grids(self):
        self.assertExpectedInline(M.causal().show(4, 6), """\
###...
####..
#####.
######""")
        self.assertExpectedInline(M.sliding_window(1, 1).show(5), """\
##...
###..
.###.
..###
...##""")
        self.assertExpectedInline(M.document([2, 3, 1]).show(6), """\
#.....
##....
..#...
..##..
..###.
.....#""")
        self.assertExpectedInline(M.shared_question(2, [2, 2]).show(6), """\
#.....
##....
###...
####..
##..#.
##..##""")
        t = torch.tensor([[[[4], [2], [6], [6], [6], [6]]]], dtype=torch.int32)
        self.assertExpectedInline(M.column_ranges(t, causal=True).show(6), """\
#.....
##....
#.#...
#.##..
..###.
..####""")

    def test_descriptor_str(self):
        d = M.document([3, 5], causal=False).compile(1, 1, 1, 8, 8, block_size=(2, 2))
        self.assertExpectedInline(str(d), """\
BlockDescriptor(Lq=8, Lk=8, block_size=(2, 2), heads=(1, 1), predicates=['col_ranges'])
[b=0, h=0]  # full, + partial, . skipped
#+..
++++
.+##
.+##""")
