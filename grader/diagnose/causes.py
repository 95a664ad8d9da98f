"""The known mistakes: each cause's stable name, what the learner is told, and the hole it is made in.

A cause says one thing or, where the mistake shows in more than one way, one thing per *form*
(``lse_log2``'s lse in base 2, or in mixed bases).  Its messages are ``str.format`` templates: the
code that finds the cause fills in where it shows and the numbers.  Its ``todo`` gives, per stage,
the label of the hole where a learner makes it, or, where the same mistake can sit in two holes,
``{learner function: label}`` (stage 2's two kernels; stage 9's PyTorch and Triton backwards); a
stage it is missing from gets no label (the mistake would sit in given code).

    CAUSES["lse_log2"].says("mixed_bases", at="b=0, head 1, row 5")
    cause("lse_log2").todo_in(3)                     # "TODO(3c)"
    named("likely cause: lse mixes bases: ...")      # "lse_log2": which cause a message is
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Diagnosis:
    cause: str          # a stable name: "lse_log2", "acc_not_rescaled", ... (a key of CAUSES)
    message: str        # what it is, why it gives these numbers, where it shows, what to change
    also: tuple[str, ...] = ()   # other causes these numbers cannot tell apart from it (same variant output)


#: What may stand around a cause's message: a headline's "likely cause, TODO(1c): " before it; after it
#: the causes it cannot be told from, the gradients that are wrong, and a check's numbers.
_BEFORE = r"(?:likely cause(?:, [^:\n]*)?: )?"
_AFTER = r"(?:\.  These inputs cannot tell it from: [^\n]*)?(?: \(wrong: [^)\n]*\))?(?:\n.*)?"


@dataclass(frozen=True)
class Cause:
    """A known mistake: its name, its messages (by form, "" when it has one), where it is made."""
    name: str
    messages: dict[str, str]
    todo: dict[int, str | dict[str, str]] = field(default_factory=dict)

    def says(self, form: str = "", **fields) -> str:
        """The message of ``form`` with ``fields`` filled in."""
        return self.messages[form].format(**fields)

    def todo_in(self, stage: int, called=()) -> str:
        """The label ("TODO(1c)") of the hole where this mistake is made in stage number ``stage``, given
        the learner functions the failing check ``called``; "" when it would sit in given code."""
        entry = self.todo.get(stage, "")
        if isinstance(entry, dict):
            return next((entry[fn] for fn in entry if fn in set(called)), "")
        return entry

    def labels(self, stage: int) -> set[str]:
        """Every label this cause may name in stage number ``stage``."""
        entry = self.todo.get(stage, "")
        return set(entry.values()) if isinstance(entry, dict) else {entry} - {""}

    def read(self, text: str, form: str | None = None) -> dict[str, str] | None:
        """The fields of ``text`` when it is this cause's message (of ``form``, if given), else None.

        ``text`` may be a whole headline or check message: "likely cause, TODO(1c): ..." and what
        follows the message are allowed around it."""
        forms = self.messages if form is None else {form: self.messages[form]}
        for template in forms.values():
            found = _pattern(template).fullmatch(text)
            if found:
                return found.groupdict()
        return None


def _pattern(template: str) -> re.Pattern:
    parts, seen = [_BEFORE], set()
    for literal, name, _spec, _conversion in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>.*?)")
            seen.add(name)
    return re.compile("".join(parts) + _AFTER, re.S)


def _literal(template: str) -> int:
    return sum(len(literal) for literal, *_ in string.Formatter().parse(template))


def _stage4(label: str, emulated: bool = False) -> dict[str, str]:
    """Stage 4: the CUDA kernel's hole, and TODO(4e) where its PyTorch emulation makes the same mistake."""
    return {"flash_attention": label} | ({"emulate_attention": "TODO(4e)"} if emulated else {})


def _stage9(label: str) -> dict[str, str]:
    """Stage 9: the PyTorch backward's one hole, or the Triton backward's hole ``label``."""
    return {"tiled_attention_backward": "TODO(9a)", "tiled_attention": "TODO(9a)", "attention_op": label,
            "attention": label}


_BOTH_9 = "TODO(9c) and TODO(9d)"

_ALL = [
    # -- the forward's statistics and scale --------------------------------------------------------
    Cause("lse_log2", {
        "in_base_2": "lse is in base 2: it is the reference x log2(e) = 1.4427 x (at {at}).  lse must be the "
                     "natural log: m + log(l), with torch.log",
        "in_base_2_exp2": "lse is in base 2: it is the reference x log2(e) = 1.4427 x (at {at}).  lse must be the "
                          "natural log: m + log(l), or (m_i + log2(l_i)) * ln(2) where the scores are in base 2 "
                          "(exp2)",
        "mixed_bases": "lse mixes bases: it is m + log2(l) with m natural (at {at}).  Use the natural log: "
                       "lse = m + log(l)"},
        {1: "TODO(1d)", 3: "TODO(3c)", 4: _stage4("TODO(4d)"), 5: "TODO(5c)"}),
    Cause("o_not_normalised", {
        "": "o is not divided by the softmax sum: it equals acc = o x l (at {at}).  Divide acc by l_i before "
            "storing o"},
        {1: "TODO(1d)", 3: "TODO(3c)", 4: _stage4("TODO(4d)"), 5: "TODO(5c)"}),
    Cause("wrong_scale", {
        "": "the output is attention computed with {used}, where it should be sm_scale = {scale:.4g} (at {at}).  "
            "Scores are sm_scale * q.k (sm_scale = 1/sqrt(D) unless given)",
        "exp2": "the output is attention computed with {used}, where it should be sm_scale = {scale:.4g} (at "
                "{at}).  Scores are sm_scale * q.k (sm_scale = 1/sqrt(D) unless given); with exp2, fold log2(e) "
                "into that scale once"},
        {1: "TODO(1c)", 3: "TODO(3b)", 4: _stage4("TODO(4a)", emulated=True)}),
    # -- memory layout ---------------------------------------------------------------------------------
    Cause("padding_columns_unmasked", {
        "": "the padding columns {first}..{last} of q and k are loaded without the head-dim mask, so they hold "
            "the next row's numbers and add to q.k (at {at}).  Load with mask=... & (offs_d < HEAD_DIM)[None, :], "
            "other=0.0"},
        {3: "TODO(3a) and TODO(3b)"}),
    Cause("wrong_strides", {
        "row_stride": "{tensor} is read with {other}'s row stride (stride_{other}n) (at {at}).  Address every "
                      "tensor with its own strides",
        "contiguous": "{tensor} is read as if it were contiguous, not with its own strides (at {at}).  Address "
                      "every tensor with its own strides",
        "x_column_stride": "x is read with the wrong strides: the kernel steps along a row with stride 1 instead "
                           "of stride_xn, true only for a contiguous x (x here has strides {strides})",
        "x_row_start": "x is read with the wrong strides: the kernel starts row r at r * N instead of r * "
                       "stride_xm, true only for a contiguous x (x here has strides {strides})"},
        {2: "TODO(2a)", 3: "TODO(3a) and TODO(3b)"}),
    # -- masks and heads ---------------------------------------------------------------------------------
    Cause("causal_top_left", {
        "": "the causal diagonal is aligned top-left (query i sees keys j <= i); the workbook aligns it "
            "bottom-right: j <= i + (N_K - N_Q) = i + {diagonal} (at {at})"},
        {4: _stage4("TODO(4b)"), 5: "TODO(5a)"}),
    Cause("causal_off_by_one", {
        "hides_own_key": "the causal mask hides each row's own key (j < i + shift instead of j <= i + shift) "
                         "(at {at})",
        "one_key_too_many": "the causal mask lets each row see one key too many, the next one (j <= i + shift "
                            "+ 1) (at {at})"},
        {4: _stage4("TODO(4b)"), 5: "TODO(5a)"}),
    Cause("mask_leak", {
        "causal": "the output is attention without the causal mask: rows see keys in their future (at {at})",
        "window": "the output ignores the window (keys that left it still count; at {at}).  Mask keys with "
                  "j <= i' - W in the blocks at the window's far edge"},
        {4: _stage4("TODO(4b)"), 5: "TODO(5a)", 7: "TODO(7a)"}),
    Cause("window_off_by_one", {
        "wide": "the window keeps W + 1 keys (j >= i' - W instead of j > i' - W) (at {at})",
        "narrow": "the window keeps W - 1 keys (the far edge is one key short) (at {at})"},
        {7: "TODO(7a)"}),
    Cause("window_top_left", {
        "": "the window is placed at the row index i instead of its diagonal i' = i + (N_K - N_Q) (at {at})",
        "tiles": "the window's mask is placed at the row index i instead of its diagonal i' = i + (N_K - N_Q), "
                 "in the key blocks the loop loads ({tiles})"},
        {7: "TODO(7a)"}),
    Cause("sink_tokens_hidden", {
        "": "the first {sink_tokens} keys (the sink tokens) are hidden from rows whose window has moved past "
            "them; they stay visible to every row (at {at})"},
        {8: "TODO(8a)"}),
    Cause("sinks_ignored", {
        "": "the learned sinks are left out: the output is attention without them (at {at}).  Each row's sum "
            "starts at exp(sinks[h]) (start m at sinks[h] in base 2 and l at 1)"},
        {8: "TODO(8b)"}),
    Cause("sinks_sign", {
        "": "the sink adds exp(-sinks[h]) to the sum instead of exp(sinks[h]) (at {at})"},
        {8: "TODO(8b)"}),
    Cause("sinks_base", {
        "": "the sink logit is used in base 2 without converting it: the sum gets 2^sinks[h] instead of "
            "e^sinks[h]; multiply it by log2(e) first (at {at})"},
        {8: "TODO(8b)"}),
    Cause("gqa_head_mapping", {
        "": "query heads use the wrong K/V head: h % Hkv instead of h // (Hq // Hkv) (Hq={hq}, Hkv={hkv}; at "
            "{at}).  A group is {group} consecutive query heads",
        "dq": "dq is computed from the wrong K/V head: query head h reads K/V head h // (Hq // Hkv) (the first "
              "Hq // Hkv query heads share K/V head 0), not h % Hkv"},
        {6: "TODO(6a)", 9: _stage9("TODO(9d)")}),
    # -- tiles the loop visits -------------------------------------------------------------------------
    Cause("masked_tiles_dropped", {
        "": "the keys of the tiles that need a mask (the diagonal band, a window's edge) are left out: only "
            "whole visible tiles count ({tiles}).  Run the masked phase over those tiles too"},
        {5: "TODO(5b)"}),
    Cause("masked_tiles_unmasked", {
        "": "the tiles that need a mask run without it: every key of the diagonal band's tiles counts, the "
            "future ones and the padding past N_K too ({tiles}).  Mask j <= i + (N_K - N_Q) in those tiles"},
        {5: "TODO(5b)"}),
    Cause("window_mask_missing", {
        "": "the window's mask is never applied: in the key blocks it loads, a row sees every key up to its "
            "own, also those that left the window ({tiles}).  Mask j > i' - W as well as j <= i'"},
        {7: "TODO(7a)"}),
    Cause("sink_blocks_skipped", {
        "": "the key blocks of the sink tokens are never visited: rows whose window has moved past them lose "
            "the first {sink_tokens} keys ({tiles}).  Loop over the sink tokens' blocks as well as the window's"},
        {8: "TODO(8c)"}),
    Cause("window_edge_unmasked", {
        "": "the tiles at the window's far edge run without the window's mask: keys that left the window still "
            "count there ({tiles}).  Mask j > i' - W in the tiles the window's edge cuts"},
        {7: "TODO(7b)"}),
    Cause("window_edge_tile_dropped", {
        "": "the tile at the window's far edge is skipped: its keys that are still inside the window are lost "
            "(the first key block is rounded up instead of down; {tiles})"},
        {7: "TODO(7b)"}),
    # -- key blocks and the online softmax ---------------------------------------------------------------
    Cause("drops_last_key_block", {
        "": "the output leaves out {keys}, the partial last key block of {block}: the loop must run over every "
            "key block, range(0, N_K, BLOCK_N) (at {at})"},
        {1: "TODO(1c)", 3: "TODO(3b)", 5: "TODO(5b)"}),
    Cause("keys_past_nk", {
        "": "keys past N_K={nk} count: the {lanes} padding lanes of the last key block (keys {first}..{last}) "
            "score 0 instead of -inf and join the softmax sum (at {at}).  Set s to -inf where cols >= N_K before "
            "the row max"},
        {1: "TODO(1c)", 3: "TODO(3b)", 4: _stage4("TODO(4b)"), 5: "TODO(5a)"}),
    Cause("acc_not_rescaled", {
        "": "acc is not rescaled when the running max grows: acc = acc * alpha + p @ v, alpha = exp(m_old - "
            "m_new) (key blocks of {block}; the error shows in rows whose max arrives after key block 0, e.g. "
            "{at})"},
        {1: "TODO(1c)", 3: "TODO(3b)", 4: _stage4("TODO(4b)", emulated=True), 5: "TODO(5a)"}),
    Cause("l_not_rescaled", {
        "": "l is not rescaled when the running max grows: l = l * alpha + rowsum(p) (key blocks of {block}; "
            "at {at})"},
        {1: "TODO(1c)", 3: "TODO(3b)", 4: _stage4("TODO(4b)", emulated=True), 5: "TODO(5a)"}),
    Cause("no_rescale", {
        "": "neither l nor acc is rescaled when the running max grows: multiply both by alpha = exp(m_old - "
            "m_new) (key blocks of {block}; at {at})"},
        {1: "TODO(1c)", 3: "TODO(3b)", 4: _stage4("TODO(4b)", emulated=True), 5: "TODO(5a)"}),
    # -- NaN and inf -----------------------------------------------------------------------------------
    Cause("nan_empty_rows", {
        "": "NaN in the rows that see no key ({rows}): {at}.  Such a row ends with m = -inf and l = 0, and 0 / 0 "
            "(or exp(-inf - -inf)) is NaN; divide by 1 where l is 0 and subtract 0 while m is -inf, so they come "
            "out o = 0, lse = -inf",
        "dq": "NaN in dq for the query rows that see no key ({rows}): their lse is -inf, so exp(s - lse) is "
              "exp(-inf + inf) = NaN, or inf where s was not masked.  Those rows must get P = 0: mask s with -inf "
              "before the exp (torch.where, never a product with the mask) and use 0 in place of an lse that is "
              "-inf"},
        {4: _stage4("TODO(4d)", emulated=True), 5: "TODO(5a) or TODO(5c)", 9: _stage9(_BOTH_9)}),
    Cause("nan_masked_tile", {
        "": "NaN in rows for which a key tile the kernel visits holds only masked keys: {at}.  While a tile "
            "holds only masked keys for a row, its max there is -inf, and exp(-inf - (-inf)) is NaN; use 0 in "
            "place of a max that is -inf (m_safe) before subtracting it",
        "softmax": "NaN or inf in {rows}, rows with -inf entries.  While a row (or a block of it) has shown only "
                   "-inf, its max is -inf and exp(-inf - (-inf)) is NaN: subtract 0 instead of a max that is "
                   "-inf, and divide by 1 where the sum is 0"},
        {1: {"online_softmax": "TODO(1a)", "flash_attention": "TODO(1c)"}, 2: "TODO(2d)", 3: "TODO(3b)",
         4: _stage4("TODO(4b)", emulated=True), 5: "TODO(5a)"}),
    Cause("nan_unwritten", {
        "": "whole query blocks {blocks} are NaN ({at}): the grader fills outputs with NaN before the kernel "
            "runs, so these were never written: is the grid cdiv(N_Q, BLOCK_M) programs per (batch, head), and "
            "does each store its rows?",
        "softmax": "every element of the output is NaN, which is how the grader hands out a new tensor "
                   "(torch.empty) before anything is stored in it: the result was never written.  Does every "
                   "block of every row reach its store (tl.store in a kernel, an assignment in PyTorch), to the "
                   "output's own pointer?"},
        {1: {"online_softmax": "TODO(1b)", "flash_attention": "TODO(1d)"},
         2: {"weighted_row_sum": "TODO(2c)", "softmax": "TODO(2f)"}, 3: "TODO(3c)", 5: "TODO(5c)"}),
    Cause("nan", {
        "": "NaN in the output: {at}.  Look for 0 / 0, exp(-inf - -inf), inf - inf, or elements of the output "
            "that are never stored (the grader fills outputs with NaN first)",
        "softmax": "NaN or inf in {rows}",
        "gradient": "NaN or inf in {gradient}: look for exp(-inf - -inf), 0 / 0, or gradient elements that are "
                    "never stored"}),
    Cause("overflow", {
        "": "inf or NaN in {rows}, rows with values up to {peak:.3g}: exp overflows past ~88 in float32.  Take "
            "exp of x - max, never of x itself"},
        {1: "TODO(1a) or TODO(1b)", 2: "TODO(2d)"}),
    # -- a row softmax and a weighted row sum (stages 1 and 2) -------------------------------------------
    Cause("softmax_no_rescale", {
        "": "the running sum is not rescaled when the max grows (blocks of {block}): l = l * exp(m - m_new) + "
            "sum(exp(x_block - m_new))"},
        {1: "TODO(1a)", 2: "TODO(2d)"}),
    Cause("softmax_pads_with_zero", {
        "": "the lanes past the end of the row (blocks of {block}) load as 0 instead of -inf, so exp(0 - m) "
            "joins the sum: load with other=-inf"},
        {1: "TODO(1a)", 2: "TODO(2d)"}),
    Cause("softmax_drops_last_block", {
        "": "the statistics leave out the last block of the row (blocks of {block}): loop over range(0, N, "
            "BLOCK_N)"},
        {1: "TODO(1a)", 2: "TODO(2d)"}),
    Cause("row_sum_drops_last_block", {
        "last_block": "the loop leaves out the last column block (blocks of {block}: {lost} never added).  Loop "
                      "over range(0, N, BLOCK_N) and mask the last block",
        "whole_blocks": "the loop runs over whole column blocks only, leaving out a partial last one (blocks of "
                        "{block}: {lost} never added).  Loop over range(0, N, BLOCK_N) and mask the last block"},
        {2: "TODO(2a)"}),
    # -- gradients (stage 9) -----------------------------------------------------------------------------
    Cause("backward_without_delta", {
        "": "dS is P * dP without the softmax's '- delta': dq and dk are off while dv is right.  dS = P * (dP - "
            "delta), with delta = rowsum(dO * O)"},
        {9: _stage9(_BOTH_9)}),
    Cause("dq_unscaled", {
        "": "dq is missing the softmax scale: it is dS @ K where it should be sm_scale * dS @ K (the scores were "
            "scaled by sm_scale in the forward)"},
        {9: _stage9("TODO(9d)")}),
    Cause("dk_unscaled", {
        "": "dk is missing the softmax scale: it is dS^T @ Q where it should be sm_scale * dS^T @ Q"},
        {9: _stage9("TODO(9c)")}),
    Cause("gqa_first_head_only", {
        "": "dk and dv hold only the first query head of each GQA group: every query head of a group reads the "
            "same K and V, so their gradients add up over the group"},
        {9: _stage9("TODO(9c)")}),
    Cause("lse_without_sink", {
        "": "P is rebuilt from an lse that leaves out the sink, as if each row's probabilities summed to 1: use "
            "the lse the forward saved, sink included",
        "empty_rows": "NaN in dq for the query rows that see no key ({rows}), whose lse is the sink alone: P is "
                      "rebuilt from an lse without the sink, -inf there.  Use the lse the forward saved, sink "
                      "included",
        "sink_takes_all": "NaN in {gradient} only where the sink takes nearly all the weight: an lse without the "
                          "sink, worked back from the saved one as lse + log(1 - exp(sink - lse)), is log(0) = "
                          "-inf there.  Use the lse the forward saved, sink included: P = exp(s - lse)"},
        {9: _stage9(_BOTH_9)}),
    Cause("mask_ignored", {
        "": "the backward rebuilds P over every key, masked ones included: apply the same mask as the forward "
            "(causal, window, sink tokens) before the exp"},
        {9: _stage9(_BOTH_9)}),
    Cause("dsinks_sign_flipped", {
        "": "d(sinks) has the wrong sign: the sink only adds to each row's normalisation, so dsinks = -sum over "
            "rows of exp(sink - lse) * delta"},
        {9: _stage9("TODO(9b)")}),
    Cause("dsinks_left_out", {
        "": "d(sinks) is zero: the sink's share of the gradient, -sum over rows of exp(sink - lse) * delta, is "
            "never added"},
        {9: _stage9("TODO(9b)")}),
]

#: Every known cause, by name.
CAUSES: dict[str, Cause] = {c.name: c for c in _ALL}


def cause(name: str) -> Cause:
    """The cause called ``name``; a KeyError names the known ones."""
    try:
        return CAUSES[name]
    except KeyError:
        raise KeyError(f"no cause {name!r}; the known ones: {', '.join(sorted(CAUSES))}") from None


def say(name: str, form: str = "", **fields) -> str:
    """Cause ``name``'s message of ``form`` with ``fields`` filled in."""
    return cause(name).says(form, **fields)


def found(name: str, form: str = "", **fields) -> Diagnosis:
    """The diagnosis cause ``name`` with its message of ``form``, ``fields`` filled in."""
    return Diagnosis(name, say(name, form, **fields))


def named(text: str) -> str | None:
    """Which cause ``text`` (a message, a headline, a check's whole message) gives, or None.  Where more
    than one message fits, the one with the most fixed text does."""
    fits = [(_literal(template), c.name) for c in CAUSES.values() for form, template in c.messages.items()
            if c.read(text, form) is not None]
    return max(fits)[1] if fits else None


def stage_number(stage: str) -> int | None:
    """3 for "stage3_flash_forward" or "stage3"; None for a name that is no stage's."""
    number = stage[5:].split("_")[0] if stage.startswith("stage") else ""
    return int(number) if number.isdigit() else None


def todo_of(name: str, stage: str, called=()) -> str:
    """The TODO label ("TODO(1c)") of the hole where cause ``name`` is made in ``stage`` (its module name,
    "stage1_online_softmax", or "stage1"), given the learner functions the failing check ``called``;
    "" when the cause belongs to no hole of that stage (it would sit in given code)."""
    number = stage_number(stage)
    return cause(name).todo_in(number, called) if number is not None and name in CAUSES else ""


def headline(found: Diagnosis, stage: str = "", called=()) -> str:
    """"likely cause, TODO(1c): ..." (the hole's label when the cause has one in ``stage``)."""
    label = todo_of(found.cause, stage, called) if stage else ""
    return f"likely cause{', ' + label if label else ''}: {found.message}"
