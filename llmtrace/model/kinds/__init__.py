"""Kinds of layer: each kind of sequence mixer is one module here, its torch code beside its declarations.

A kind is a `model.transformer.Module` subclass that a family's `Block.attention_of` puts in a layer. Besides its
forward pass it declares, in its own file:

- `KIND`: its key ("attention", "linear_attention", "mla", "mamba2", "short_conv"), which the layer plan carries and
  the views translate; never an English phrase used as a protocol value;
- `POINTS`, `weights()` and `maths(x, plan)`: its named tensors, its weights with their HF and GGUF keys, and each
  point's operation (model.maths), as attention does;
- `memory()`: what it keeps between passes (model.memory.Memory: per-token entries, a constant-size state, or an
  earlier layer's entries it reads); `KVCache` allocates exactly that and hands it to the layer as `io.cache`
  (a LayerKV for K and V, a LayerSlots for other per-token entries, a LayerState for constant tensors);
- `flops(n_tokens)`: multiply-add FLOPs (2 per multiply-add) of its matrix products over a pass of n tokens, as
  rows (key, label, formula, FLOPs), the label an (English, Chinese) pair, and `FLOPS_NOTE`, what they count, a pair
  too: explain says them in the view's language (render.say.Say.pick);
- `EXPLAIN`: explain's own sections for the kind, by key: a section the kind computes itself is its method
  `explain(key, cap, model, maths, head)` in its own file (MLA's "latent_cache", Mamba2's "state_update", the short
  convolution's "convolution"); the older shared ones are run.explain's MIXER_SECTIONS ("attention", "delta_rule");
  their words in explain's catalogues (render/catalogue/);
- `HEADINGS`: the seed steps its points sit under, each with the heading a learner reads for this kind, in English
  and Chinese ({"s6.3": ("causal convolution", "因果卷积"), ...}); a step it does not name keeps the seed table's
  heading. A kind that is not attention never borrows attention's headings.

Attention itself (`model.transformer.Attention`) declares the same; the families' variants subclass it.
"""
