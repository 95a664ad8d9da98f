"""Wrong stage 8 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("sink_tokens_masked_out", "loads the sink tokens' blocks but lets the window's mask hide them",
           edits=[("        in_window = in_window | (cols[None, :] < SINK_TOKENS)\n", "")],
           caught_by=["sink_tokens_with_window", "everything_together"], diagnosis="sink_tokens_hidden"),
    Mutant("sink_tokens_dropped", "never visits the sink tokens' own range of key blocks",
           edits=[("    sink_hi = tl.minimum((SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)\n",
                   "    sink_hi = 0\n")],
           caught_by=["sink_tokens_with_window"], diagnosis="sink_blocks_skipped"),
    Mutant("sink_range_overlaps_window", "does not stop the sink range at the window's first block, so blocks "
                                         "in both ranges are counted twice",
           edits=[("sink_hi = tl.minimum((SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)",
                   "sink_hi = (SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N")],
           caught_by=["sink_tokens_with_window"]),
    Mutant("sink_tokens_scan_every_block", "right answers in O(N^2): the sink range runs from block 0 all the "
                                           "way to the window, masking everything in between",
           edits=[("sink_hi = tl.minimum((SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)", "sink_hi = lo")],
           caught_by=["sink_tokens_visited_not_scanned"]),
    Mutant("learned_sink_natural_log", "starts the running max at sinks[h] without converting it to base 2",
           edits=[("tl.load(SINKS + h) / LN2", "tl.load(SINKS + h)")],
           caught_by=["learned_sinks"], diagnosis="sinks_base"),
    Mutant("learned_sink_sign_flipped", "adds exp(-sinks[h]) to the denominator instead of exp(sinks[h])",
           edits=[("tl.load(SINKS + h) / LN2", "-tl.load(SINKS + h) / LN2")],
           caught_by=["learned_sinks", "learned_sinks_rows_that_see_no_key"], diagnosis="sinks_sign"),
    Mutant("learned_sink_not_in_sum", "starts the running max at the sink but its sum at 0: the sink never "
                                      "reaches the denominator, and lse leaves it out",
           edits=[("        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)\n", "")],
           caught_by=["learned_sinks"], diagnosis="sinks_ignored"),
    Mutant("learned_sinks_ignored", "accepts sinks and never uses them",
           edits=[("    if HAS_SINKS:\n        m_i = ", "    if False:\n        m_i = ")],
           caught_by=["learned_sinks", "learned_sinks_rows_that_see_no_key", "everything_together"],
           diagnosis="sinks_ignored"),
]
