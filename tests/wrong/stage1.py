"""Wrong stage 1 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("softmax_no_rescale", "adds each block's exponentials without rescaling the old sum",
           edits=[("l = l * torch.exp(m - m_safe) + torch.exp", "l = l + torch.exp")],
           caught_by=["softmax_awkward_lengths"], diagnosis="softmax_no_rescale"),
    Mutant("softmax_nan_on_masked_rows", "subtracts a max of -inf, so all-masked blocks give NaN",
           edits=[("m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)",
                   "m_safe = m_new")],
           caught_by=["softmax_minus_inf"], diagnosis="nan_masked_tile"),
    Mutant("softmax_no_max", "takes exp of the raw values, which overflows at 1e4",
           edits=[("m_new = torch.maximum(m, xb.amax(dim=-1))", "m_new = torch.zeros_like(m)"),
                  ("m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)", "m_safe = torch.zeros_like(m)")],
           caught_by=["softmax_large_values"], diagnosis="overflow"),
    Mutant("attention_acc_not_rescaled", "rescales l but not acc when the max grows",
           edits=[("acc = acc * alpha[..., None] + p @ vj", "acc = acc + p @ vj")],
           caught_by=["attention_matches_reference"], diagnosis="acc_not_rescaled"),
    Mutant("attention_wrong_scale", "scales the scores by 1/D instead of 1/sqrt(D)",
           edits=[("scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)",
                   "scale = sm_scale if sm_scale is not None else 1.0 / D")],
           caught_by=["attention_matches_reference"], diagnosis="wrong_scale"),
    Mutant("attention_lse_log2", "returns the log-sum-exp in base 2",
           edits=[("lse[:, :, i0:i0 + block_m] = m + torch.log(l)",
                   "lse[:, :, i0:i0 + block_m] = m + torch.log2(l)")],
           caught_by=["attention_lse_and_scale"], diagnosis="lse_log2"),
    Mutant("attention_drops_last_block", "loops over whole key blocks only, dropping a partial last one",
           edits=[("for j0 in range(0, Nk, block_n):", "for j0 in range(0, Nk - block_n + 1, block_n):")],
           caught_by=["attention_matches_reference"], diagnosis="drops_last_key_block"),
]
