"""Checks for lesson 09's second exercise: one LARS update (You, Gitman & Ginsburg, 2017).

    lars_step(params, grads, lr, trust_coef=0.001, weight_decay=0.0) -> list[torch.Tensor]
        for every layer (tensor) w with gradient g:
            ratio = trust_coef · ‖w‖ / (‖g‖ + weight_decay · ‖w‖)     (1 when ‖w‖ or ‖g‖ is 0)
            new w = w − lr · ratio · (g + weight_decay · w)
        the new parameters, one tensor per input tensor, same shapes and dtypes; inputs untouched.

Each rank draws its own layers (so 1–4 ranks check 1–4 times as many), among them the layers
that break naive code: a layer of zeros (a bias at initialisation: ‖w‖ = 0), a layer whose
gradient is zero (with and without weight decay), and both. Known slips and what they produce
here: no trust ratio (plain SGD), one ratio for the whole model instead of one per layer,
‖g + wd·w‖ in the denominator, weight decay left out (a decay large enough to show: wd·‖w‖ half
of ‖g‖ in one case), dividing by a zero norm (NaN, or a layer that never moves), and a guard on
the denominator instead of on ‖g‖ (a zero gradient with weight decay then takes trust / wd), weight
decay outside the ratio's scaling (AdamW's way), and LARC's clipping of the ratio at 1: every case with
zeros in it has a decay of 0.05 and a layer whose ratio is above 1, so each slip fails all but the cases
it cannot change (no decay there, or every ratio below 1).
"""
from __future__ import annotations

from hpdl.checker.cases import Case, Wrong

SIGNATURE = "lars_step(params, grads, lr, trust_coef=0.001, weight_decay=0.0) -> list[torch.Tensor]"
RANKS = (1, 2, 3, 4)
TIMEOUT = 20.0


def cases(size: int) -> list[Case]:
    return [
        Case("one layer, no weight decay", {"shapes": [[10, 8]], "lr": 0.1, "trust": 0.001, "wd": 0.0, "seed": 1}),
        Case("layers of different scales", {"shapes": [[16, 8], [16], [4, 16], [4]], "lr": 1.0, "trust": 0.02,
                                            "wd": 0.0, "scales": [1.0, 0.01, 30.0, 0.5], "seed": 2}),
        # a decay that counts: wd·‖w‖ half of ‖g‖ here (at 5e-4, weight decay left out entirely, or put inside
        # the gradient's norm, moved the weights by less than float32's tolerance and passed)
        Case("with weight decay", {"shapes": [[32, 3, 3, 3], [32], [10, 32]], "lr": 2.0, "trust": 0.001,
                                   "wd": 0.05, "seed": 3}),
        # the cases with zeros in them: a decay large enough to show, and a layer whose ratio is above 1 (a gradient
        # small beside its weights). At a decay of 1e-4 a decay left out of the ratio's scaling passed them, and with
        # every ratio below 1 so did LARC's clipping at 1 (24/32 and 28/32)
        Case("a layer of zeros (‖w‖ = 0)", {"shapes": [[8, 8], [8]], "lr": 0.5, "trust": 0.1, "wd": 0.05,
                                          "zero_w": [1], "scales": [10.0, 1.0], "seed": 4}),
        Case("a zero gradient (‖g‖ = 0)", {"shapes": [[8, 8], [8]], "lr": 0.5, "trust": 0.01, "wd": 0.0,
                                          "zero_g": [0], "scales": [1.0, 10.0], "seed": 5}),
        # and with weight decay: a guard on the denominator instead of on ‖g‖ gave it trust / wd (2 here, 100 at a
        # decay of 1e-4), and only a hidden case had one (24/28)
        Case("a zero gradient with weight decay", {"shapes": [[8, 8], [8]], "lr": 0.5, "trust": 0.1, "wd": 0.05,
                                                   "zero_g": [0], "scales": [1.0, 10.0], "seed": 8}),
        Case("zero weights and zero gradient", {"shapes": [[6, 4], [6], [3, 6]], "lr": 0.5, "trust": 0.1,
                                                "wd": 0.05, "zero_w": [1], "zero_g": [1], "scales": [10.0, 1.0, 1.0],
                                                "seed": 6}),
        Case("hidden: float64, many layers", {"shapes": [[5, 5]] * 6 + [[5]] * 3, "lr": 3.0, "trust": 0.005,
                                              "wd": 1e-3, "zero_w": [7], "zero_g": [2, 7], "dtype": "float64",
                                              "scales": [10.0] + [1.0] * 8, "seed": 7}, hidden=True),
    ]


def inputs(case: Case, rank: int, size: int) -> tuple:
    import torch

    p = case.params
    dtype = getattr(torch, p.get("dtype", "float32"))
    g = torch.Generator().manual_seed(1000 * p["seed"] + rank)
    scales = p.get("scales") or [1.0] * len(p["shapes"])
    params = [torch.randn(*s, generator=g, dtype=dtype) * sc for s, sc in zip(p["shapes"], scales)]
    grads = [torch.randn(*s, generator=g, dtype=dtype) * 0.1 / sc for s, sc in zip(p["shapes"], scales)]
    for i in p.get("zero_w", []):
        params[i].zero_()
    for i in p.get("zero_g", []):
        grads[i].zero_()
    return params, grads, p["lr"], p["trust"], p["wd"]


def call(fn, comm, args):
    """The step on this rank's layers; what it changed in place of its inputs, if anything, instead (the caller's
    parameters and gradients are theirs: an optimizer's step is not this function's to take)."""
    import torch

    params, grads, lr, trust, wd = args
    before = [t.clone() for t in (*params, *grads)]
    new = fn(params, grads, lr, trust, wd)
    changed = [i for i, (t, old) in enumerate(zip((*params, *grads), before)) if not torch.equal(t, old)]
    if changed:
        n = len(params)
        return {"changed": [f"params[{i}]" if i < n else f"grads[{i - n}]" for i in changed]}
    return new


def reference(comm, params, grads, lr, trust_coef, weight_decay):
    import torch

    out = []
    for w, g in zip(params, grads):
        w_norm, g_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
        if w_norm > 0 and g_norm > 0:
            ratio = trust_coef * w_norm / (g_norm + weight_decay * w_norm)
        else:
            ratio = torch.ones((), dtype=w.dtype)
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def verify(case: Case, ctx) -> Wrong | None:
    import torch

    from hpdl.checker import hooks

    got = ctx.got
    if isinstance(got, dict) and "changed" in got:
        return Wrong(f"lars_step changed its inputs in place ({', '.join(map(str, got['changed'][:4]))}): it returns "
                     "the new parameters and leaves params and grads as they were",
                     hint="compute each new tensor, w - lr * ratio * (g + weight_decay * w), rather than w.sub_(...) "
                          "or g.zero_().")
    if isinstance(got, (list, tuple)) and any(isinstance(t, torch.Tensor) and not torch.isfinite(t).all()
                                             for t in got):
        bad = [i for i, t in enumerate(got) if isinstance(t, torch.Tensor) and not torch.isfinite(t).all()]
        return Wrong(f"layer(s) {bad} came out NaN or infinite",
                     hint="a norm of zero ended up in a denominator: when ‖w‖ or ‖g‖ is 0, use a ratio of 1.")
    # float64 layers: within 1e-7 of the formula, not float64's 200 ulp. A ratio rounded through float32 on the way
    # (torch.tensor(a Python float)), or the small eps LARC implementations add to the denominator, is 1e-9 to
    # 1e-10 off, and scored 24/28 with a message quoting the same value twice; every known slip is far beyond
    float64 = any(str(getattr(t, "dtype", "")).endswith("float64") for t in ctx.expected)
    wrong = hooks.compare(got, ctx.expected, what="new parameters", **({"rtol": 1e-7, "atol": 1e-9} if float64 else {}))
    if wrong is not None:
        wrong.hint = wrong.hint or _why(ctx)
    return wrong


def _why(ctx) -> str | None:
    """Compare with the known slips, on this rank's inputs."""
    import torch

    params, grads, lr, trust, wd = ctx.args
    got = ctx.got
    if not isinstance(got, (list, tuple)) or len(got) != len(params):
        return None

    def close(candidate):
        return all(torch.allclose(torch.as_tensor(a, dtype=b.dtype), b, rtol=1e-4, atol=1e-6)
                   for a, b in zip(got, candidate))

    return next((why for candidate, why in _slips(params, grads, lr, trust, wd) if close(candidate)), None)


def _slips(params, grads, lr, trust, wd) -> list[tuple[list, str]]:
    """Each known slip's step on these inputs, with what to say when a learner's matches it (first match)."""
    import torch

    norm = torch.linalg.vector_norm
    sgd = [w - lr * (g + wd * w) for w, g in zip(params, grads)]
    w_all = torch.sqrt(sum(norm(w) ** 2 for w in params))
    g_all = torch.sqrt(sum(norm(g) ** 2 for g in grads))
    global_ratio = trust * w_all / (g_all + wd * w_all) if g_all > 0 and w_all > 0 else 1.0
    one_ratio = [w - lr * global_ratio * (g + wd * w) for w, g in zip(params, grads)]
    combined = []
    for w, g in zip(params, grads):
        d = g + wd * w
        r = trust * norm(w) / norm(d) if norm(w) > 0 and norm(d) > 0 else 1.0
        combined.append(w - lr * r * d)
    undecayed = [w - lr * (trust * norm(w) / norm(g) if norm(w) > 0 and norm(g) > 0 else 1.0) * g
                 for w, g in zip(params, grads)]
    guarded, stuck = [], []
    for w, g in zip(params, grads):
        d = norm(g) + wd * norm(w)
        guarded.append(w - lr * (trust * norm(w) / d if norm(w) > 0 and d > 0 else 1.0) * (g + wd * w))
        stuck.append(w - lr * (trust * norm(w) / d if d > 0 else 1.0) * (g + wd * w))
    ratios = [trust * norm(w) / (norm(g) + wd * norm(w)) if norm(w) > 0 and norm(g) > 0 else 1.0
              for w, g in zip(params, grads)]
    decoupled = [w - lr * r * g - lr * wd * w for (w, g), r in zip(zip(params, grads), ratios)]
    plain_ratio = [w - lr * (trust * norm(w) / norm(g) if norm(w) > 0 and norm(g) > 0 else 1.0) * (g + wd * w)
                   for w, g in zip(params, grads)]
    clipped = [w - lr * min(float(r), 1.0) * (g + wd * w) for (w, g), r in zip(zip(params, grads), ratios)]
    decayed_still = wd and any(norm(g) == 0 and norm(w) > 0 for w, g in zip(params, grads))
    return [
        (sgd, "that is plain SGD: scale each layer's step by its trust ratio trust_coef · ‖w‖ / (‖g‖ + wd · ‖w‖)."),
        (one_ratio, "one ratio for the whole model: LARS computes a ratio per layer (per tensor), from that layer's "
                    "norms."),
        *([(undecayed, "weight_decay is left out: it is in the step, g + weight_decay · w, and in the ratio's "
                       "denominator, ‖g‖ + weight_decay · ‖w‖.")] if wd else []),
        # a guard on the denominator: a zero gradient with weight decay took trust / weight_decay (24/28); before
        # `combined`, which gives the same there
        *([(guarded, "a layer whose gradient is zero takes a ratio of 1, as one of zeros does: with weight decay "
                     "the formula gives trust_coef / weight_decay there, a step far too long. Test ‖w‖ and ‖g‖, "
                     "not the denominator.")] if decayed_still else []),
        *([(decoupled, "the weight decay is scaled by the ratio too: the step is lr · ratio · (g + weight_decay · w), "
                       "not lr · ratio · g plus a decay of its own."),
           (plain_ratio, "weight_decay belongs in the ratio's denominator as well: ‖g‖ + weight_decay · ‖w‖, not "
                         "‖g‖ alone.")] if wd else []),
        (combined, "the denominator is ‖g‖ + weight_decay · ‖w‖ (You et al.), not ‖g + weight_decay · w‖."),
        (clipped, "the ratio is capped at 1 (LARC's clipping): LARS takes it as it is, above 1 too."),
        (stuck, "a layer of zeros gets a ratio of 0 and never moves (biases start at zero): when ‖w‖ or ‖g‖ is 0 "
                "use a ratio of 1."),
    ]
