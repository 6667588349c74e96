"""The explain page in Chinese: the terminal explain's lines (render/explain.py, English) said in the seeds' terms.

The terminal renderer is the one source of what the explain page holds (report.explain_view); this module turns each
of its lines into the page's language, in two passes:

    LINES     a whole line, by its pattern: the sentence in Chinese, its numbers and names kept (\\g<name>)
    PHRASES   what is left, phrase by phrase (table headers, cells, the tail of a line no pattern knows)

Names, ids, shapes, numbers and formulas stay as they are. A line that still has English words after both passes is
marked lang="en" on the page (report/templates/report/explain.html.j2), so the page never claims a language it does
not speak.
"""

from __future__ import annotations

import re

N = r"[-\d.,e+%×KMGiB ]+?"  # a number as the terminal prints it (1,024 · 3.5e-05 · 7.00 KiB · 50.8%)

LINES = [(re.compile(p), r) for p, r in (
    (r"^(?P<n>[①-⑨]) s6  where the layer sits: layer (?P<l>\d+) is decoder layer (?P<k>\d+) of (?P<of>\d+)$",
     r"\g<n> s6  这一层在哪里：第 \g<l> 层是第 \g<k> 个解码器层（共 \g<of> 层）"),
    (r"^= (?P<a>\S+) of the model's (?P<b>\S+) parameters \((?P<c>\S+) of the weights outside the embedding and final "
     r"norm; the embedding table holds (?P<d>\S+)\)$",
     r"= 模型 \g<b> 个参数的 \g<a>（嵌入和最终归一化之外权重的 \g<c>；嵌入表有 \g<d> 个）"),
    (r"^2 FLOPs per multiply-add; the scores count the full T×T square the eager path computes \(the causal mask then "
     r"discards the upper half\)$", "每次乘加算 2 次浮点运算；分数按 eager 路径计算的完整 T×T 方阵计数（因果掩码随后丢弃上半部分）"),
    (r"^(?P<n>[①-⑨]) RMSNorm ×2 \(before attention, before the FFN\): (?P<f>.*)$",
     r"\g<n> RMSNorm 归一化 ×2（注意力之前、前馈网络之前）：\g<f>"),
    (r"^ε = (?P<e>\S+); γ is learned, one weight per dimension$", r"ε = \g<e>；γ 是学习得到的，每个维度一个权重"),
    (r"^(?P<p>\w+) γ: mean (?P<m>\S+), min (?P<mi>\S+), max (?P<ma>\S+) \(largest \|γ\| at dims (?P<d>.*)\); "
     r"max \|y − forward pass\| = (?P<x>\S+)$",
     r"\g<p> γ：均值 \g<m>，最小 \g<mi>，最大 \g<ma>（|γ| 最大的维度 \g<d>）；与前向计算的最大差 |y − 前向| = \g<x>"),
    (r"^dividing by the RMS gives every token the same length (?P<l>.*?), whatever its scale; γ then re-weights each of "
     r"the D dimensions \(learned\), which sets the final length$",
     r"除以 RMS 让每个词元无论原来大小都得到相同的长度 \g<l>；然后 γ 对 D 个维度分别重新加权（学习得到），决定最终长度"),
    (r"^(?P<n>[①-⑨]) s6.1–s6.2  Q, K, V and the head split: (?P<r>.*) query heads, (?P<s>.*)$",
     r"\g<n> s6.1–s6.2  Q、K、V 与拆分为多头：\g<r> 个查询头，\g<s>"),
    (r"^grouped-query attention \(GQA\): (?P<g>\d+) query heads share each KV head$",
     r"分组查询注意力 GQA：每 \g<g> 个查询头共享一个 KV 头"),
    (r"^multi-head attention: every query head has its own K and V \(no sharing\)$",
     "多头注意力：每个查询头都有自己的 K 和 V（不共享）"),
    (r"^  KV head (?P<k>\d+) ← query heads (?P<q>.*)$", r"  KV 头 \g<k> ← 查询头 \g<q>"),
    (r"^KV cache per position per layer: (?P<f>.*) = (?P<b>\S+ B) instead of (?P<m>\S+ B) with one KV head per query "
     r"head: (?P<x>\S+) smaller \(this prompt, all layers: (?P<a>.*) instead of (?P<am>.*)\)$",
     r"每层每个位置的 KV 缓存：\g<f> = \g<b>，若每个查询头各有一个 KV 头则为 \g<m>：小 \g<x>（这个提示、所有层："
     r"\g<a>，而不是 \g<am>）"),
    (r"^(?P<n>[①-⑨]) s6.3  RoPE on q and k: base θ = (?P<b>\S+), (?P<s>.*)$",
     r"\g<n> s6.3  对 q 和 k 施加旋转位置编码 RoPE：基数 θ = \g<b>，\g<s>"),
    (r"^θ_i = base\^\(-2i/Dh\); pair \(x_i, x_\{i\+Dh/2\}\) at position m is rotated by m·θ_i$",
     "θ_i = base^(-2i/Dh)；位置 m 上的一对 (x_i, x_{i+Dh/2}) 旋转 m·θ_i"),
    (r"^angles in radians; fast pairs \(small i\) turn in a few positions and see nearby order, slow pairs barely turn "
     r"and carry long-range position. V is not rotated.$",
     "角度单位为弧度；快的对（i 小）几个位置就转一圈，感知近处的顺序；慢的对几乎不转，携带远距离的位置信息。V 不旋转。"),
    (r"^relative distance: the real q of head (?P<h>\d+) \(last token\) and k of KV head (?P<k>\d+) \(first token\), "
     r"placed at positions (?P<p>.*) and (?P<q>\S+)$", r"相对距离：头 \g<h> 的真实 q（最后一个词元）与 KV 头 \g<k> 的 k"
                                                      r"（第一个词元），放在位置 \g<p> 和 \g<q>"),
    (r"^(?P<c>[✓✗]) q·k/√Dh is the same wherever the pair sits, given d \(largest spread (?P<s>\S+)\); it changes when "
     r"d changes$", r"\g<c> 给定 d，无论这对放在哪里，q·k/√Dh 都相同（最大偏差 \g<s>）；d 变化时它才变化"),
    (r"^the model's RoPE tables reproduce its q_rope / k_rope to (?P<a>.*)$",
     r"模型自己的 RoPE 表复现它的 q_rope / k_rope，差 \g<a>"),
    (r"^(?P<n>[①-⑨]) s6.4–s6.5  attention: scores (?P<s>\S+(?: \S+)*?) → causal mask → softmax → P·V$",
     r"\g<n> s6.4–s6.5  注意力：分数 \g<s> → 因果掩码 → softmax → P·V"),
    (r"^(?P<f>P = .*?) above the diagonal; O = P V; the mask sets (?P<m>\S+) entries \(every key after its query\) to −∞$",
     r"\g<f> 在对角线之上；O = P V；掩码把 \g<m> 个元素（每个查询之后的键）设为 −∞"),
    (r"^scores before the mask: min (?P<a>\S+), max (?P<b>\S+); after \(the entries a position may see\): min (?P<c>\S+), "
     r"max (?P<d>\S+); every softmax row sums to 1 \(largest error (?P<e>\S+)\)$",
     r"掩码前的分数：最小 \g<a>，最大 \g<b>；掩码后（一个位置能看到的元素）：最小 \g<c>，最大 \g<d>；"
     r"每行 softmax 之和为 1（最大误差 \g<e>）"),
    (r"^head (?P<h>\d+): scores, masked →−∞$", r"头 \g<h>：分数，被掩码的 →−∞"),
    (r"^\(the first (?P<n>\d+) positions of (?P<t>\d+)\)$", r"（\g<t> 个位置中的前 \g<n> 个）"),
    (r"^the key each position attends to most, per head \(position:weight\)$", "每个头中，每个位置最关注的键（位置:权重）"),
    (r"^attention map, (?P<w>.*) \((?P<h>.*)\): rows are queries, columns keys; pick a head with (?P<how>\S+)$",
     r"注意力图，\g<w>（\g<h>）：行是查询，列是键；用 \g<how> 选择一个头"),
    (r"^(?P<n>[①-⑨]) s6.6  output projection and residual: (?P<f>.*)$", r"\g<n> s6.6  输出投影与残差：\g<f>"),
    (r"^x enters the layer; attn = what attention adds to it; x' = x \+ attn \(so (?P<a>.*)\); x'' = x' \+ FFN\(x'\) "
     r"leaves the layer. A cosine near 1: the layer nudged the token's vector rather than replacing it$",
     r"x 进入这一层；attn = 注意力加给它的量；x' = x + attn（所以 \g<a>）；x'' = x' + FFN(x') 离开这一层。"
     r"余弦接近 1：这一层只是轻推了词元的向量，而不是替换它"),
    (r"^(?P<n>[①-⑨]) s6.7  (?P<k>\S+) feed-forward, D → F → D$", r"\g<n> s6.7  \g<k> 前馈网络，D → F → D"),
    (r"^(?P<f>\w+)\(gate\) near zero \(\|·\| < (?P<t>\S+)\): (?P<a>\S+) of all units; gate < 0 for (?P<b>\S+); "
     r"(?P<f2>\w+)\(gate\) mean (?P<m>\S+), max (?P<x>\S+); act = (?P<f3>\w+)\(gate\)⊙up matches the forward pass to "
     r"(?P<d>\S+)$", r"\g<f>(gate) 接近 0（|·| < \g<t>）：占全部单元的 \g<a>；gate < 0 的占 \g<b>；\g<f>(gate) 均值 \g<m>，"
                     r"最大 \g<x>；act = \g<f>(gate)⊙up 与前向计算相差 \g<d>"),
    (r"^the most active units for the last token \(position (?P<p>\d+), (?P<t>.*)\), by \|act\|$",
     r"最后一个词元（位置 \g<p>，\g<t>）最活跃的单元，按 |act| 排序"),
    (r"^(?P<n>[①-⑨]) s6.8  KV cache write: this layer stores K and V for positions (?P<p>\S+)$",
     r"\g<n> s6.8  写入 KV 缓存：这一层保存位置 \g<p> 的 K 和 V"),
    (r"^K (?P<k>\[.*?\]) and V (?P<v>\[.*?\]) × (?P<e>\d+) B = (?P<b>\S+) B \((?P<p>\S+) B per position\); every layer "
     r"together: (?P<a>.*)$", r"K \g<k> 和 V \g<v> × \g<e> B = \g<b> B（每个位置 \g<p> B）；所有层合计：\g<a>"),
    (r"^with one KV head per query head this layer would write (?P<b>\S+) B; later decode steps read these instead of "
     r"recomputing them$", r"若每个查询头各有一个 KV 头，这一层要写 \g<b> B；之后的解码步骤读取它们而不必重新计算"),
    (r"^(?P<n>[①-⑨]) s8–s9 early  logit lens at layer (?P<l>\d+), last position \((?P<p>\d+)\)$",
     r"\g<n> s8–s9 提前  第 \g<l> 层的 logit 透镜，最后一个位置（\g<p>）"),
    (r"^what the model would predict if it stopped here: the final norm and the LM head applied to the stream$",
     "如果模型在这里停下会预测什么：把最终归一化和 LM 头应用到残差流上"),
    (r"^every observed point of layer (?P<l>\d+) \(the tensor events of --json\)$",
     r"第 \g<l> 层的每个观测点（--json 中的 tensor 事件）"),
    (r"^(?P<n>\d+) tokens: (?P<t>.*)$", r"\g<n> 个词元：\g<t>"),
    (r"^(?P<n>\d+) positions in (?P<b>\d+) bins \(keys summed, queries averaged per bin\)$",
     r"\g<n> 个位置分成 \g<b> 个区间（每个区间内键求和、查询取平均）"),
    (r"^ *(?P<l>(?:\S+ +\S+%? +)+)\(blank: masked, in the future\)$", r"\g<l>（空白：被掩码，是未来的位置）"),
    (r"^ *(?P<l>(?:\S+ +\S+%? +)+)\(blank: masked, in the future; ╳: out of the window\)$",
     r"\g<l>（空白：被掩码，是未来的位置；╳：在窗口之外）"),
    (r"^a sliding-window layer: each query sees only the last (?P<w>\d+) keys, the band along the diagonal \(╳: out of "
     r"the window\)$", r"滑动窗口层：每个查询只看最后 \g<w> 个键，即沿对角线的带状区域（带状区域之外：在窗口之外）"),
    (r"^a global layer: every query sees every earlier key \(the model's other layers see only the last (?P<w>\d+)\)$",
     r"全局层：每个查询看到之前所有的键（模型的其他层只看最后 \g<w> 个）"),
    # a family's differences from Llama (model/families/*: the explain header's table)
    (r"^(?P<f>\w+): what it changes from Llama$", r"\g<f>：与 Llama 的不同之处"),
    (r"^embedding × √D = (?P<x>.*) \(s4\)$", r"嵌入 × √D = \g<x>（s4）"),
    (r"^RMSNorm scales by 1 \+ w \(a GGUF stores 1 \+ w\)$", "RMSNorm 乘以 1 + w（GGUF 中存的是 1 + w）"),
    (r"^four norms a layer: before attention, on its output \(s6.6\), before the FFN, on its output \(s6.7\)$",
     "每层四个归一化：注意力之前、注意力输出上（s6.6）、前馈网络之前、前馈网络输出上（s6.7）"),
    (r"^scores × (?P<s>\S+) \(query_pre_attn_scalar (?P<q>\S+), = Dh here\)$",
     r"分数 × \g<s>（query_pre_attn_scalar \g<q>，这里等于 Dh）"),
    (r"^scores × (?P<s>\S+) \(query_pre_attn_scalar (?P<q>\S+)\) instead of (?P<d>.*)$",
     r"分数 × \g<s>（query_pre_attn_scalar \g<q>），而不是 \g<d>"),
    (r"^scores soft-capped (?P<f>\S+) before the mask \(s6.4\)$", r"分数在掩码之前做软上限 \g<f>（s6.4）"),
    (r"^GeGLU feed-forward: (?P<f>.*), width (?P<w>\d+)$", r"GeGLU 前馈网络：\g<f>，宽度 \g<w>"),
    (r"^logits soft-capped (?P<f>\S+) \(s9\)$", r"logits 做软上限 \g<f>（s9）"),
    (r"^(?:layer (?P<l>\d+) of (?P<n>\d+) sees|(?P<k>\d+) of (?P<m>\d+) layers see|every layer sees) only the last "
     r"(?P<w>\d+) tokens \(a sliding window, not a context limit: positions go on to (?P<p>\d+); the KV cache keeps "
     r"every slot\)$", lambda m: (f"第 {m['l']} 层（共 {m['n']} 层）" if m["l"] else f"{m['m']} 层中有 {m['k']} 层"
                                 if m["k"] else "每一层都") + f"只看最后 {m['w']} 个词元（滑动窗口，不是上下文长度限制："
                                f"位置一直到 {m['p']}；KV 缓存保留每个槽位）"),
    (r"^layers? (?P<l>[\d, ]+) of (?P<n>\d+) keep a dense SwiGLU feed-forward \(width (?P<w>\S+)\)$",
     r"\g<n> 层中的第 \g<l> 层保留稠密的 SwiGLU 前馈网络（宽 \g<w>）"),
    (r"^q/k RMSNorm per head \(width (?P<w>\d+)\) after the split into heads, before RoPE$",
     r"q/k 在拆分为多头之后、RoPE 之前按头做 RMSNorm（宽 \g<w>）"),
    (r"^q/k RMSNorm over the whole projection \(width (?P<q>\d+) for q, (?P<k>\d+) for k\), before the split into "
     r"heads$", r"q/k 在拆分为多头之前对整个投影做 RMSNorm（q 宽 \g<q>，k 宽 \g<k>）"),
    (r"^RoPE base (?P<a>\S+) in the sliding-window layers, (?P<b>\S+) in the global ones$",
     r"RoPE 基数：滑动窗口层 \g<a>，全局层 \g<b>"),
    (r"^feed-forward: (?P<e>\d+) SwiGLU experts \(width (?P<w>\d+)\) and a router; (?P<p>p = .*?) in float32, each "
     r"token runs its top (?P<k>\d+) experts, weights (?P<how>.*?); output (?P<o>.*)$",
     r"前馈网络：\g<e> 个 SwiGLU 专家（宽 \g<w>）和一个路由器；\g<p>（float32），每个词元运行概率最高的 \g<k> 个专家，"
     r"权重\g<how>；输出 \g<o>"),
    # a layer's memory as its kind declares it (render.explain._memory: an MLA layer's latent and RoPE key)
    (r"^(?P<n>[①-⑨]) s6.8  cache write: this layer keeps (?P<p>.*) for each of (?P<t>\d+) positions$",
     lambda m: f"{m['n']} s6.8  写入缓存：这一层为 {m['t']} 个位置中的每一个保存 " + m["p"].replace(" and ", " 和 ")),
    (r"^(?P<b>\S+) B per position, (?P<t>\S+) B for this pass; every layer together: (?P<a>.*)$",
     r"每个位置 \g<b> B，本次前向 \g<t> B；所有层合计：\g<a>"),
    (r"^full multi-head attention with these heads would keep (?P<m>\S+) B \((?P<x>\S+)× more\)$",
     r"同样头数的完整多头注意力要保存 \g<m> B（多 \g<x>×）"),
    # DeepSeek V2/V3 (model/families/deepseek.py)
    (r"^multi-head latent attention: (?P<q>q through a code of (?P<rq>\S+) \(RMS-normed\)|q projected directly); K and V "
     r"up-projected from a cached latent of (?P<r>\S+) and one RoPE key of (?P<dr>\S+) shared by the (?P<h>\d+) heads; "
     r"each head's key (?P<dn>\d+) \+ (?P<dr2>\d+) dims, value (?P<dv>\d+)$",
     lambda m: ("多头潜在注意力（MLA）：" + (f"q 经过宽 {m['rq']} 的低秩编码（RMS 归一化）" if m["rq"] else "q 直接投影")
                + f"；K 和 V 由缓存的 {m['r']} 维潜变量上投影得到，另有一个 {m['dr']} 维的 RoPE 键由 {m['h']} 个头共用；"
                  f"每个头的键 {m['dn']} + {m['dr2']} 维，值 {m['dv']} 维")),
    (r"^the cache keeps (?P<n>\S+) numbers a token a layer, where multi-head attention with these heads would keep "
     r"(?P<m>\S+) \((?P<x>\S+)×\); llmtrace up-projects K and V from the latent at every step, as transformers does \(the "
     r"absorbed form folds W_kb into q and W_vb into W_o\)$",
     r"缓存每层每个词元保存 \g<n> 个数，而同样头数的多头注意力要保存 \g<m> 个（\g<x>×）；llmtrace 与 transformers 一样，每一步"
     r"都从潜变量上投影出 K 和 V（吸收形式则把 W_kb 并入 q、把 W_vb 并入 W_o）"),
    (r"^scores scaled by (?P<s>\S+) \((?P<l>.*)\); RoPE on (?P<p>adjacent pairs|the halves) of the rope dims$",
     lambda m: f"分数乘以 {m['s']}（{m['l']}）；RoPE 作用于 rope 维的" + ("相邻成对维度" if m["p"] == "adjacent pairs"
                                                                      else "前后两半")),
    (r"^YaRN RoPE: factor (?P<f>\S+) over an original context of (?P<n>\S+)$",
     r"YaRN RoPE：在原始上下文 \g<n> 上放大 \g<f> 倍"),
    (r"^feed-forward: (?P<e>\d+) routed SwiGLU experts \(width (?P<w>\S+)\), each token's top (?P<k>\d+) experts? by "
     r"(?P<c>sigmoid scores, chosen by score \+ a correction bias \(the bias chooses, the score weighs\)|\w+ scores)"
     r"(?:, within the best (?P<gu>\d+) of (?P<g>\d+) groups of experts)?; weights (?P<how>renormalised to sum to 1|not "
     r"renormalised), × (?P<x>\S+); plus (?P<n>\d+) shared experts? \(one SwiGLU of width (?P<fs>\S+)\) every token runs$",
     lambda m: (f"前馈网络：{m['e']} 个路由 SwiGLU 专家（宽 {m['w']}），每个词元按 "
                + ("sigmoid 分数选出前 " if m["c"].startswith("sigmoid") else f"{m['c'].split()[0]} 分数选出前 ")
                + f"{m['k']} 个专家" + ("（分数加上修正偏置来选择，权重只用分数本身）" if "bias" in m["c"] else "")
                + (f"，只在 {m['g']} 组中最好的 {m['gu']} 组里选" if m["g"] else "")
                + ("；权重重新归一化使和为 1" if m["how"].startswith("renormalised") else "；权重不重新归一化")
                + f"，× {m['x']}；另有 {m['n']} 个共享专家（一个宽 {m['fs']} 的 SwiGLU），每个词元都运行")),
    (r"^the first (?:(?P<n>\d+) layers|layer) of (?P<l>\d+) keeps? a dense SwiGLU \(width (?P<w>\S+)\)$",
     lambda m: f"{m['l']} 层中的前 {m['n'] or 1} 层保留稠密的 SwiGLU（宽 {m['w']}）"),
    (r"^q, k and v read from one fused matrix \((?P<r>.*) rows\), split as the maths reads it$",
     r"q、k、v 从一个融合矩阵中读出（\g<r> 行），按数学公式的写法拆开"),
    (r"^RoPE on (?P<n>\d+) of (?P<d>\d+) dims of each head \(dims (?P<a>\S+) turn, (?P<b>\S+) pass unchanged\)$",
     r"RoPE 只作用于每个头 \g<d> 维中的 \g<n> 维（第 \g<a> 维旋转，第 \g<b> 维不变）"),
    (r"^gate and up read from one fused matrix \((?P<r>.*) rows, gate first\)$",
     r"gate 和 up 从一个融合矩阵中读出（\g<r> 行，gate 在前）"),
    (r"^no norm before attention: the stream goes in as it is; attention's output is RMS-normed, then added$",
     "注意力之前没有归一化：残差流原样进入；注意力的输出先做 RMS 归一化，再相加"),
    (r"^no norm before the feed-forward: its output is RMS-normed, then added$",
     "前馈网络之前没有归一化：它的输出先做 RMS 归一化，再相加"),
    (r"^head width (?P<w>\d+) given on its own: (?P<f>.*), not the width (?P<d>\d+)$",
     r"头宽 \g<w> 单独给出：\g<f>，而不是模型宽度 \g<d>"),
    (r"^LongRoPE: short factors up to (?P<n>\d+) positions, long beyond \(a cached sequence is computed again with them "
     r"when it first passes (?P<m>\d+), as transformers does\); cos and sin × (?P<x>\S+)$",
     r"LongRoPE：\g<n> 个位置以内用短因子，超过则用长因子（缓存的序列在第一次超过 \g<m> 时用它们重新计算，与 transformers "
     r"相同）；cos 和 sin × \g<x>"),
    (r"^(?P<f>P = .*?) above the diagonal and (?P<n>\d+) or more keys back \(the sliding window\); O = P V; the mask sets "
     r"(?P<m>\S+) entries \(every key after its query, and every key (?P<n2>\d+) or more back\) to −∞$",
     r"\g<f> 在对角线之上以及往回 \g<n> 个及更远的键（滑动窗口）；O = P V；掩码把 \g<m> 个元素（每个查询之后的键，以及往回 "
     r"\g<n2> 个及更远的键）设为 −∞"),
    (r"^(?P<n>[①-⑨]) s6.3  RoPE on q and k: base θ = (?P<b>\S+), the sliding-window layers' own table, no scaling$",
     r"\g<n> s6.3  对 q 和 k 施加旋转位置编码 RoPE：基数 θ = \g<b>，滑动窗口层自己的表，无缩放"),
    # a mixture of experts: the router
    (r"^(?P<p>p = softmax\(.*?\)) in float32; the K most probable experts run; (?P<r>.*)$",
     r"\g<p>（float32）；概率最高的 K 个专家运行；\g<r>"),
    (r"^bold: the experts a token ran; the cut: the K-th probability against the best one left out(?P<m>.*?); weights "
     r"(?P<how>.*?); bits: the router's entropy \(log2 (?P<e>\d+) = (?P<b>\S+) when it cannot choose\)$",
     r"粗体：词元运行的专家；分界：第 K 个概率与落选者中最好的一个相比\g<m>；权重\g<how>；bits：路由器的熵（无法选择时为 "
     r"log2 \g<e> = \g<b>）"),
    (r"^load over the prompt \(tokens per expert\): (?P<l>.*)$", r"整个提示上的负载（每个专家的词元数）：\g<l>"),
    # the steps of a layer as the model declares them (render.explain._steps; the formulas come in the page's
    # language from the declaration itself: explain_view.localized)
    (r"^⓪ s6  layer (?P<l>\d+)'s steps, as the model declares them: attention (?P<a>.*); RoPE (?P<r>.*); "
     r"(?P<f>\w+) feed-forward$", r"⓪ s6  第 \g<l> 层的各步，按模型的声明：注意力 \g<a>；RoPE \g<r>；\g<f> 前馈网络"),
    (r"^each formula applied in float64 to this pass's own inputs, beside the value the pass computed \(largest "
     r"\|difference\|\): (?P<c>\d+) of (?P<n>[\d,]+) steps? checked, (?P<ok>.*); — marks a step with nothing to "
     r"recompute \(the cache's slots\) or an input this pass did not keep$",
     r"每个公式在 float64 下作用于本次前向自己的输入，与前向算出的值并列（最大 |差|）：\g<n> 步中检查了 \g<c> 步，"
     r"\g<ok>；— 表示没有可重算的内容（缓存槽位）或本次前向没有保留某个输入"),
    (r"^(?P<n>[①-⑨]) RMSNorm ×2 \(before attention, before the FFN\)$", r"\g<n> RMSNorm 归一化 ×2（注意力之前、前馈网络之前）"),
    (r"^(?P<n>[①-⑨]) RMSNorm ×(?P<k>\d+) \((?P<l>.*)\)$", r"\g<n> RMSNorm 归一化 ×\g<k>（\g<l>）"),
    (r"^(?P<n>[①-⑨]) s6.3  RoPE on q and k: no rotation in this layer$", r"\g<n> s6.3  对 q 和 k 施加 RoPE：这一层不旋转"),
    (r"^this layer turns neither q nor k: .*$", "这一层既不旋转 q 也不旋转 k：查询对键的分数只取决于两个词元是什么（内容），"
     "而不取决于它们相隔多远。有 RoPE 的层把位置带进残差流；这一层只按内容做注意力。"),
    (r"^q_rope equals its input to (?P<x>\S+)$", r"q_rope 与它的输入相差 \g<x>"),
    (r"^(?P<f>.*); the mask sets (?P<m>\S+) entr(?:y|ies) \(every key after its query, and every key (?P<w>\d+) or more "
     r"back\) to −∞$", r"\g<f>；掩码把 \g<m> 个元素（每个查询之后的键，以及往回 \g<w> 个及更远的键）设为 −∞"),
    (r"^(?P<f>.*); the mask sets (?P<m>\S+) entr(?:y|ies) \(every key after its query\) to −∞$",
     r"\g<f>；掩码把 \g<m> 个元素（每个查询之后的键）设为 −∞"),
    (r"^(?P<n>[①-⑨]) s6.3  RoPE on q and k: base θ = (?P<b>\S+), rotary width (?P<w>\d+) of (?P<d>\d+), (?P<s>.*)$",
     r"\g<n> s6.3  对 q 和 k 施加旋转位置编码 RoPE：基数 θ = \g<b>，旋转宽度 \g<w>/\g<d>，\g<s>"),
)]

# phrase by phrase, longest first: table headers and cells, and what no line pattern covers
PHRASES = sorted({
    "FLOPs for this prompt": "本提示的浮点运算", "formula": "公式", "Q, K, V projections": "Q、K、V 投影",
    "scores Q·Kᵀ": "分数 Q·Kᵀ", "weights · V": "权重 · V", "output projection": "输出投影", "feed-forward": "前馈网络",
    "total": "合计", "step": "步骤", "weight": "权重", "shape": "形状", "parameters": "参数量", "of layer": "占本层",
    "projection": "投影", "split into heads": "拆分为多头", "heads first": "头维在前", "pair i": "对 i", "dims": "维度",
    "turn every": "转一圈需", "spread": "偏差", "token": "词元", "pos": "位置", "rank": "排名", "unit": "单元",
    "after attention": "注意力之后", "after the FFN": "前馈网络之后", "real output": "真实输出", "after layer": "第几层之后：",
    "point": "观测点", "mean": "均值", "std": "标准差", "min": "最小", "max": "最大", "mean on 0": "对 0 的平均",
    "units ≈ 0": "≈0 的单元", "rad/pos": "弧度/位置", "attn_norm output": "attn_norm 的输出",
    "ffn_norm output": "ffn_norm 的输出", "softmax P": "softmax P", "mean over heads": "所有头的平均",
    "positions": "个位置", "no scaling": "无缩放", "layer": "层", "of": "/", "weights": "权重",
    "head": "头", "query heads": "查询头", "the router": "路由器", "experts": "专家",
    "renormalised to sum to 1": "重新归一化为和为 1", "as the softmax gave them": "保持 softmax 给出的值",
    " (closest margin": "（最小差距", "out of the window": "在窗口之外", "(not renormalised)": "（没有重新归一化）",
    "as it is": "保持原值", "the sliding-window layers' own table": "滑动窗口层自己的表", "no scaling": "无缩放",
    "formula, with this layer's constants": "公式（本层的常数）", "computed vs trace": "计算值 vs 追踪", "op": "运算",
    "all agree": "全部一致", "a window of": "窗口", "keys": "个键", "global: every earlier key": "全局：之前所有的键",
    "base θ": "基数 θ", "no rotation in this layer": "这一层不旋转", "dense": "稠密", "experts": "专家",
    "rotary width": "旋转宽度",
}.items(), key=lambda kv: -len(kv[0]))

_WORDS = re.compile(r"[A-Za-z]+(?:[-'][A-Za-z]+)*")
_PHRASE = re.compile("|".join(r"(?<![A-Za-z_])" + re.escape(k) + r"(?![A-Za-z_])" for k, _ in PHRASES))
_PHRASE_OF = dict(PHRASES)


def translate_line(text: str) -> str:
    """A whole line of the terminal explain, in Chinese where a pattern knows it (else phrase by phrase)."""
    for pattern, replacement in LINES:
        if pattern.match(text):  # then the phrases left in what the line carries over (a margin, a weighting)
            text = pattern.sub(replacement, text)
            break
    return _PHRASE.sub(lambda m: _PHRASE_OF[m.group(0)], text)


def english_run(text: str, n: int = 3) -> bool:
    """Whether `text` still has n English words in a row (names with _ . or digits are not words)."""
    run = 0
    for token in text.split():
        word = token.strip("()[]{},.;:!?\"'“”‘’")
        run = run + 1 if word and _WORDS.fullmatch(word) else 0
        if run >= n:
            return True
    return False
