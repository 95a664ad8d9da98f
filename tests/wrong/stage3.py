"""Wrong stage 3 solutions the checks must reject."""

from grader.testing.mutants import Mutant

MUTANTS = [
    Mutant("acc_not_rescaled", "rescales l but not acc when the running max grows",
           edits=[("acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)", "acc = acc + tl.dot(p.to(v.dtype), v)")],
           caught_by=["block_shapes"], diagnosis="acc_not_rescaled"),
    Mutant("exp_with_log2e_scale", "takes the natural exp of scores already scaled by log2(e): "
           "softmax at the wrong temperature",
           edits=[("alpha = tl.exp2(m_i - m_new)", "alpha = tl.exp(m_i - m_new)"),
                  ("p = tl.exp2(s - m_new[:, None])", "p = tl.exp(s - m_new[:, None])")],
           caught_by=["custom_scale"], diagnosis="wrong_scale"),
    Mutant("exp2_without_log2e", "uses exp2 but forgets to fold log2(e) into the scale",
           edits=[("        scale * LOG2E,\n", "        scale,\n")],
           caught_by=["custom_scale"], diagnosis="wrong_scale"),
    Mutant("padding_keys_leak", "never masks keys past N_K: the zero-padded keys of the last block score 0 "
           "and add exp2(0 - m) to the denominator (visible only when Nk is no multiple of BLOCK_N)",
           edits=[("        s = tl.where(col_ok[None, :], s, float(\"-inf\"))\n", "")],
           caught_by=["sequence_lengths", "unequal_lengths"], diagnosis="keys_past_nk"),
    Mutant("lse_base2", "stores the log-sum-exp in base 2 instead of the natural log",
           edits=[("(m_i + tl.log2(l_i)) * LN2", "(m_i + tl.log2(l_i))")],
           caught_by=["head_dims_powers_of_two"], diagnosis="lse_log2"),
    Mutant("padding_columns_unmasked", "loads Q and K without the head-dim mask, so for D that is not a power "
           "of two the padding columns hold the next row's (or head's) numbers and leak into q.k",
           edits=[("q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)",
                   "q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)"),
                  ("k = tl.load(k_base + cols[:, None] * stride_kn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)",
                   "k = tl.load(k_base + cols[:, None] * stride_kn, mask=col_ok[:, None], other=0.0)")],
           caught_by=["head_dims_padded"], diagnosis="padding_columns_unmasked"),
    Mutant("drops_partial_last_key_block", "loops over whole key blocks only, skipping a partial last one",
           edits=[("for start_n in range(0, N_K, BLOCK_N):", "for start_n in range(0, N_K - BLOCK_N + 1, BLOCK_N):")],
           caught_by=["unequal_lengths", "block_shapes"], diagnosis="drops_last_key_block"),
    Mutant("o_not_normalised", "stores acc without dividing by the running sum l",
           edits=[("o = acc / l_i[:, None]", "o = acc")],
           caught_by=["float16"], diagnosis="o_not_normalised"),
    Mutant("scale_from_padded_head_dim", "takes the default scale 1/sqrt(D) from the padded head dim",
           edits=[("scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)",
                   "scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_pad)")],
           caught_by=["head_dims_padded"], diagnosis="wrong_scale"),
    Mutant("v_with_k_strides", "walks V's rows with K's row stride",
           edits=[("cols[:, None] * stride_vn", "cols[:, None] * stride_kn")],
           caught_by=["non_contiguous"], diagnosis="wrong_strides"),
    Mutant("o_with_q_strides", "stores o with q's strides, which differ when q is a slice of a wider tensor",
           edits=[("o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on "
                   "+ offs_d[None, :] * stride_od",
                   "o_ptrs = O + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn "
                   "+ offs_d[None, :] * stride_qd")],
           caught_by=["non_contiguous"]),
    Mutant("padding_waste_of_real_dim", "divides the padding by the real head dim instead of the padded one",
           edits=[("return (padded - head_dim) / padded", "return (padded - head_dim) / head_dim")],
           caught_by=["padding_waste_values"]),
]
