"""Wrong stage 5 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("top_left_alignment", "aligns the diagonal top-left (query i sees keys j <= i) when Nq != Nk",
           edits=[("    shift = N_K - N_Q ", "    shift = 0 ")],
           caught_by=["causal_bottom_right"], diagnosis="causal_top_left"),
    Mutant("diagonal_off_by_one", "hides each row's own key: j < i + shift instead of j <= i + shift",
           edits=[("visible = visible & (cols[None, :] <= rows[:, None] + shift)",
                   "visible = visible & (cols[None, :] < rows[:, None] + shift)")],
           caught_by=["causal_square", "causal_bottom_right"], diagnosis="causal_off_by_one"),
    Mutant("running_max_not_nan_safe", "stage 3's update: subtracts a running max that is still -inf "
                                       "for a row that has seen no key, so exp2(-inf - -inf) = NaN",
           edits=[("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "m_safe = m_new")],
           caught_by=["rows_that_see_no_key", "causal_bottom_right"], diagnosis="nan_empty_rows"),
    Mutant("tile_local_max", "exponentiates each tile against its own row max: a row fully masked inside "
                             "a tile (block_m != block_n) has max -inf there and turns NaN",
           edits=[("    p = tl.exp2(s - m_safe[:, None])\n"
                   "    l_i = l_i * alpha + tl.sum(p, axis=1)\n"
                   "    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)\n",
                   "    m_tile = tl.max(s, axis=1)\n"
                   "    p = tl.exp2(s - m_tile[:, None])\n"
                   "    beta = tl.exp2(m_tile - m_safe)\n"
                   "    l_i = l_i * alpha + tl.sum(p, axis=1) * beta\n"
                   "    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v) * beta[:, None]\n")],
           caught_by=["causal_asymmetric_blocks"], diagnosis="nan_masked_tile"),
    Mutant("empty_rows_divide_by_zero", "divides by l even where it is 0: rows that see no key give 0/0 = NaN",
           edits=[("l_safe = tl.where(l_i == 0.0, 1.0, l_i)", "l_safe = l_i")],
           caught_by=["rows_that_see_no_key"], diagnosis="nan_empty_rows"),
    Mutant("diagonal_band_skipped", "never runs the masked phase, dropping the keys of the diagonal band",
           edits=[("visits, full_hi, hi, shift,", "visits, full_hi, full_hi, shift,")],
           caught_by=["causal_square", "causal_bottom_right"], diagnosis="masked_tiles_dropped"),
    Mutant("whole_blocks_rounded_up", "rounds full_hi up, so the diagonal's own block runs unmasked and rows "
                                      "see future keys",
           edits=[("full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N",
                   "full_hi = (tl.maximum(start_m + shift + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N")],
           caught_by=["causal_square"], diagnosis="masked_tiles_unmasked"),
    Mutant("no_block_skipping", "right answers, but loads every key block, masking those above the diagonal "
                                "instead of skipping them",
           edits=[("hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), N_K)", "hi = N_K")],
           caught_by=["blocks_above_diagonal_skipped"]),
]
