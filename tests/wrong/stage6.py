"""Wrong stage 6 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("heads_interleaved", "maps query head h to K/V head h % Hkv, interleaving the groups instead of "
                                "giving each K/V head Hq // Hkv consecutive query heads",
           edits=[("    h_kv = h // GROUP\n", "    h_kv = h % (H // GROUP)\n")],
           caught_by=["gqa_groups"], diagnosis="gqa_head_mapping"),
    Mutant("grid_over_kv_heads", "launches one program per K/V head instead of per query head, so most "
                                 "query heads are never computed",
           edits=[('return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq',
                   'return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hkv')],
           caught_by=["gqa_groups", "mqa", "gqa_blocks_skipped"], diagnosis="nan_unwritten"),
    Mutant("top_left_alignment", "stage 5 regression: aligns the causal diagonal top-left when Nq != Nk",
           edits=[("    shift = N_K - N_Q ", "    shift = 0 ")],
           caught_by=["gqa_causal_edge_cases", "mqa"], diagnosis="causal_top_left"),
    Mutant("running_max_not_nan_safe", "stage 5 regression: subtracts a running max that is still -inf",
           edits=[("m_safe = tl.where(m_new == float(\"-inf\"), 0.0, m_new)", "m_safe = m_new")],
           caught_by=["gqa_causal_edge_cases"], diagnosis="nan_empty_rows"),
]
