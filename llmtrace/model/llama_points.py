"""Llama's observable points, declared once: the modules of model/transformer.py list them in their POINTS (a family
declares its own in its file). Free of torch, so that a trace written before traces carried their points can still be
read and drawn without it (trace.reader), and code that takes one point apart (explain's sections) names it here."""

from llmtrace.model.points import Point

# the model, outside the layers (s4, then s7-s9)
EMBED = Point("embed", "s4", ("T", "D"), editable=True, about="each token's row of the embedding matrix")
FINAL_NORM = Point("final_norm", "s8", ("T", "D"), about="RMSNorm after the last layer")
LAST = Point("last", "s7", ("D",), about="the last position, which predicts the next token")
LOGITS = Point("logits", "s9", ("V",), about="one score per vocabulary entry")

# a layer's residual stream and norms
RESID_PRE = Point("resid_pre", "s6", ("T", "D"), editable=True, traced=False, residual=True,
                  about="the stream entering the layer")
ATTN_NORM = Point("attn_norm", "s6.1", ("T", "D"), about="RMSNorm before attention", input="resid_pre")
RESID_MID = Point("resid_mid", "s6.6", ("T", "D"), editable=True, residual=True, about="stream + attention")
FFN_NORM = Point("ffn_norm", "s6.7", ("T", "D"), about="RMSNorm before the feed-forward", input="resid_mid")
RESID_POST = Point("resid_post", "s6.7", ("T", "D"), editable=True, residual=True,
                   about="stream + feed-forward: the layer's output")

# the attention sub-layer (s6.1-s6.6, s6.8)
Q = Point("q", "s6.1/s6.2", ("T", "H", "Dh"), editable=True, about="queries X·Wq, split into heads")
K = Point("k", "s6.1/s6.2", ("T", "Hkv", "Dh"), editable=True, about="keys X·Wk, split into KV heads")
V = Point("v", "s6.1/s6.2", ("T", "Hkv", "Dh"), editable=True, about="values X·Wv, split into KV heads")
Q_ROPE = Point("q_rope", "s6.3", ("T", "H", "Dh"), about="queries rotated by their positions", input="q")
K_ROPE = Point("k_rope", "s6.3", ("T", "Hkv", "Dh"), about="keys rotated by their positions", input="k")
KV_WRITE = Point("kv_write", "s6.8", ("T",), stored=False, about="the cache slots this pass writes")
K_REPEATED = Point("k_repeated", "s6.4", ("H", "S", "Dh"), stored=False,
                   about="each KV head's keys, seen by its G heads")
SCORES = Point("scores", "s6.4", ("H", "T", "S"), about="Q·Kᵀ·scale, masked keys at -inf")
PROBS = Point("probs", "s6.5", ("H", "T", "S"), editable=True, about="softmax of the scores: each row sums to 1")
ATTN_OUT = Point("attn_out", "s6.5", ("T", "H", "Dh"), editable=True, about="each head's P·V")
O_PROJ = Point("o_proj", "s6.6", ("T", "D"), editable=True, about="the heads concatenated, times Wo")
# the points whose formulas make attention's one line in explain (scores, softmax, P·V), in every language
ATTENTION_LINE = (SCORES.name, PROBS.name, ATTN_OUT.name)

# the feed-forward sub-layer (s6.7)
GATE = Point("gate", "s6.7", ("T", "F"), about="X·W_gate")
UP = Point("up", "s6.7", ("T", "F"), about="X·W_up")
ACT = Point("act", "s6.7", ("T", "F"), editable=True, about="act(gate) ⊙ up")
DOWN = Point("down", "s6.7", ("T", "D"), editable=True, about="back to the width: ·W_down")


def llama_points():
    """Llama's declaration as `Transformer.declared_points()` makes it (tests/test_architecture checks they agree):
    what a trace written before traces carried their points was recorded with."""
    from llmtrace.model.points import Points, with_where

    block = with_where((RESID_PRE, ATTN_NORM), "block")
    attn = with_where((Q, K, V, Q_ROPE, K_ROPE, KV_WRITE, K_REPEATED, SCORES, PROBS, ATTN_OUT, O_PROJ), "attn")
    ffn = with_where((GATE, UP, ACT, DOWN), "ffn")
    layer = block + attn + with_where((RESID_MID, FFN_NORM), "block") + ffn + with_where((RESID_POST,), "block")
    return Points(with_where((EMBED,), "model"), layer, with_where((FINAL_NORM, LAST, LOGITS), "model"))
