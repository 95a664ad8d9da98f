"""Wrong stage 7 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("window_off_by_one", "keeps W + 1 keys: j >= i' - W instead of j > i' - W",
           edits=[("in_window = cols[None, :] > rows[:, None] + shift - WINDOW",
                   "in_window = cols[None, :] >= rows[:, None] + shift - WINDOW")],
           caught_by=["window_sizes", "window_short_sequences"], diagnosis="window_off_by_one"),
    Mutant("window_top_left", "places the window at the row index i instead of its diagonal i + (Nk - Nq)",
           edits=[("in_window = cols[None, :] > rows[:, None] + shift - WINDOW",
                   "in_window = cols[None, :] > rows[:, None] - WINDOW")],
           caught_by=["window_bottom_right"], diagnosis="window_top_left"),
    Mutant("window_mask_missing", "skips the blocks behind the window but never masks the keys that left it "
                                  "inside the blocks it loads",
           edits=[("visible = visible & _in_window(offs_m, cols, shift, WINDOW)", "visible = visible")],
           caught_by=["window_sizes"], diagnosis="window_mask_missing"),
    Mutant("loop_from_block_0", "right answers in O(N^2): starts every query block's loop at key block 0 and "
                                "masks the keys before the window instead of skipping them",
           edits=[("lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N", "lo = 0")],
           caught_by=["window_work_is_o_n_w"]),
    Mutant("window_start_rounded_up", "rounds the first key block up, losing the keys of a block only partly "
                                      "inside the window",
           edits=[("lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N",
                   "lo = (tl.maximum(start_m + shift - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N")],
           caught_by=["window_sizes"], diagnosis="window_edge_tile_dropped"),
    Mutant("no_masked_edge", "treats every block from lo on as inside every row's window, so the leading "
                             "edge runs unmasked",
           edits=[("    full_lo = (tl.maximum(start_m + BLOCK_M + shift - WINDOW, 0) + BLOCK_N - 1) "
                   "// BLOCK_N * BLOCK_N\n", "    full_lo = lo\n")],
           caught_by=["window_sizes"], diagnosis="window_edge_unmasked"),
    Mutant("ranges_overlap", "does not cap full_lo at full_hi: with a window shorter than the query block, the "
                             "leading edge and the diagonal band visit the same blocks twice",
           edits=[("    full_lo = tl.minimum(full_lo, full_hi)\n", "")],
           caught_by=["window_sizes", "window_asymmetric_blocks"]),
    Mutant("running_max_not_nan_safe", "stage 5's NaN trap, met with Nq = Nk: a row whose first tile hides "
                                       "all its keys subtracts a running max of -inf",
           edits=[("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "m_safe = m_new")],
           caught_by=["window_asymmetric_blocks"], diagnosis="nan_masked_tile"),
]
