"""TriStateCache where transformers takes a DynamicCache: torch.compile(fullgraph=True) of a decode step
(hfkv.compiled), torch.export (hfkv.export), and subclasses of it, each against the eager DynamicCache run."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from transformers import DynamicCache

import hfkv
from hfkv.compiled import CompiledDecode
from tests.models import tiny_model

PROMPT = 20


@torch.no_grad()
def _decode(model, step, cache, ids, new: int = 16) -> torch.Tensor:
    tok = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tokens = [tok]
    for i in range(new):
        pos = torch.tensor([[ids.shape[1] + i]])
        tok = step(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(tok)
    return torch.cat(tokens, 1)


CASES = {
    "dynamic": lambda m: DynamicCache(),
    "full": lambda m: hfkv.TriStateCache(m, "full"),
    "hfkv-dense": lambda m: hfkv.TriStateCache(m, "hfkv", budget=4096),
    "hfkv-tiers": lambda m: hfkv.TriStateCache(m, "hfkv", budget=16, window=4, backend="torch"),
    "evict": lambda m: hfkv.TriStateCache(m, "evict", budget=12, window=4, backend="torch"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_decode_step_gives_the_eager_tokens(case):
    """fullgraph=True: a step that traced runs compiled (once traced, the sizes that grow are dynamic, so a step
    between policy runs is not traced again), a policy run or a dense layer leaving stays eager."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    ref = _decode(model, model, CASES[case](model), ids)
    torch._dynamo.reset()
    step = CompiledDecode(model, backend="eager")
    try:
        assert torch.equal(_decode(model, step, CASES[case](model), ids), ref)
    finally:
        torch._dynamo.reset()
    assert step.counts["compiled"] >= (8 if case in ("hfkv-tiers", "evict") else 16)
    if case in ("dynamic", "full", "hfkv-dense"):
        assert step.counts["eager"] == 0


def test_a_compressed_step_is_not_recompiled_for_state_made_on_first_use():
    """Dynamo guards on every Python attribute a traced step reads: state a layer made lazily (the window's empty
    exits, once built on the first push that displaced nothing) recompiled the step once it existed. Between policy
    runs a compressed step recompiles for nothing of that kind (what remains: sizes 0 and 1, which Dynamo
    specialises)."""
    from torch._dynamo.utils import guard_failures

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    guard_failures.clear()
    step = CompiledDecode(model, backend="eager")
    try:
        _decode(model, step, CASES["evict"](model), ids, new=40)
        reasons = [str(r) for failures in guard_failures.values() for r in failures]
    finally:
        torch._dynamo.reset()
    assert step.counts["compiled"] >= 16
    assert reasons == [], reasons


def _assert_same_state(got, want, exact: bool) -> None:
    """Every compressed layer holds the same positions and score sums (what attention adds to in place and the
    policy reads): bit for bit, or (``exact=False``: inductor's model arithmetic rounds otherwise) to 1e-4. A
    step's lost score writes would be off by a whole step's probabilities."""
    for a, b in zip(got.compressed_layers(), want.compressed_layers(), strict=True):
        pairs = [(a.window.raw()[2], b.window.raw()[2], True), (a.window.raw()[3], b.window.raw()[3], False)]
        for tier in range(a.tiers.num_tiers):
            (pa, sa, va), (pb, sb, vb) = a.tiers.read_meta(tier), b.tiers.read_meta(tier)
            pairs += [(pa, pb, True), (va, vb, True), (sa, sb, False)]
        for x, y, positional in pairs:
            if exact or positional:
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def _compiled_step_matches_eager(cache_backend: str, seed: int, new: int, exact: bool, **options) -> None:
    """Compiled steps (``options`` go to torch.compile) give the eager tokens, with at least 8 steps compiled, and
    leave the cache holding what the eager run holds (``_assert_same_state``)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))

    def make():
        return hfkv.TriStateCache(model, "hfkv", budget=16, window=4, backend=cache_backend)

    eager = make()
    ref = _decode(model, model, eager, ids, new=new)
    torch._dynamo.reset()
    step = CompiledDecode(model, **options)
    compiled = make()
    try:
        assert torch.equal(_decode(model, step, compiled, ids, new=new), ref)
    finally:
        torch._dynamo.reset()
    assert step.counts["compiled"] >= 8
    _assert_same_state(compiled, eager, exact=exact)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_inductor_compiles_a_compressed_step(backend):
    """On the torch backend a step is torch ops; on the CPU backend the kernel is the operator
    hfkv::paged_attention_cpu, whose in-place score sums must land in the cache as eagerly (the policy reads them):
    the tokens and every held byte equal the eager run's."""
    _compiled_step_matches_eager(backend, seed=1, new=10, exact=False)  # inductor


def test_the_cpu_kernel_steps_compile_to_the_eager_tokens():
    """Dynamo cannot trace ctypes: the CPU kernel goes into the graph as an operator (fullgraph=True holds)."""
    _compiled_step_matches_eager("cpu", seed=2, new=12, exact=True, backend="eager")


def test_crop_while_dense_is_dynamic_caches_crop_and_assisted_decoding_matches_greedy():
    """While the budget covers the sequence a layer is dense and crops as DynamicLayer does: the held keys and the
    next logits equal DynamicCache's after the same crop, and prompt-lookup decoding (which crops rejected
    candidates) gives DynamicCache's greedy tokens."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    dyn, tri = DynamicCache(config=model.config), hfkv.TriStateCache(model, "hfkv", budget=4096)
    with torch.no_grad():
        for cache in (dyn, tri):
            model(input_ids=ids, past_key_values=cache)
            assert cache.is_croppable
            cache.crop(-5)
        assert tri.get_seq_length() == dyn.get_seq_length() == PROMPT - 5
        for a, b in zip(tri.layers, dyn.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        nxt = ids[:, PROMPT - 5 : PROMPT - 3]
        pos = torch.arange(PROMPT - 5, PROMPT - 3)[None]
        want = model(input_ids=nxt, past_key_values=dyn, position_ids=pos).logits
        assert torch.equal(model(input_ids=nxt, past_key_values=tri, position_ids=pos).logits, want)
    text = torch.cat([ids[:, :10], ids[:, :10]], 1)  # repeats: prompt lookup finds candidates
    kw = dict(max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    ref = model.generate(text, past_key_values=DynamicCache(config=model.config), max_new_tokens=12, do_sample=False)
    out = model.generate(text, past_key_values=hfkv.TriStateCache(model, "hfkv", budget=4096), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("filled", [False, True], ids=["prefill", "decode"])
def test_torch_export_of_the_full_preset(filled):
    model = tiny_model("mistral")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))

    def cache():
        c = hfkv.TriStateCache(model, "full")
        if filled:
            model(input_ids=ids, past_key_values=c, use_cache=True)
        return c

    ref_cache = DynamicCache()
    if filled:
        model(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    step = ids[:, -1:] if filled else ids
    kwargs = {"input_ids": step, "use_cache": True}
    if filled:
        kwargs["position_ids"] = torch.tensor([[9]])
    ep = torch.export.export(model, (), {**kwargs, "past_key_values": cache()}, strict=False)
    got = ep.module()(**kwargs, past_key_values=cache())
    ref = model(**kwargs, past_key_values=ref_cache)
    assert isinstance(got.past_key_values, hfkv.TriStateCache)
    assert torch.allclose(got.logits, ref.logits, atol=1e-5)
    for a, b in zip(got.past_key_values.layers, ref.past_key_values.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_export_names_what_a_compressed_preset_lacks_and_subclasses_register():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="uncompressed 'full' preset, not 'hfkv'"):
        pytree.tree_flatten(hfkv.TriStateCache(model, "hfkv"))

    class Mine(hfkv.TriStateCache):
        pass

    cache = Mine(model, "full")
    model(input_ids=torch.randint(3, 128, (1, 5)), past_key_values=cache)
    leaves, spec = pytree.tree_flatten(cache)
    assert len(leaves) == 2 * model.config.num_hidden_layers
    again = pytree.tree_unflatten(leaves, spec)
    assert type(again) is Mine
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(again.layers, cache.layers, strict=True))


@pytest.mark.parametrize("preset", ["hfkv", "evict"])
def test_offloading_moves_storage_after_attention_and_back_before_the_next_update(monkeypatch, preset):
    """``offloading=True`` as DynamicCache takes it. On a CPU the host is the device, so the moves are made visible:
    each copies, and attention checks that it reads storage on the device. Tokens are those of a cache without
    offloading; each layer's storage went out and came back at every step."""
    from hfkv.layer import offload as offload_mod
    from hfkv.layer.layer import TriStateLayer

    moved: list[tuple[int, str]] = []
    original = offload_mod.Offload._move

    def copying_move(self, device):
        moved.append((self.layer.layer_idx, "host" if not self.on_host else "device"))
        original(self, device)
        dense, ring = self.layer.dense, self.layer.window
        for owner, name in ((dense, "k"), (dense, "v")) + (((ring, "_k"), (ring, "_v")) if ring else ()):
            if getattr(owner, name) is not None:
                setattr(owner, name, getattr(owner, name).clone())  # a new tensor, as a copy to another device

    attend = TriStateLayer._attend_stored

    def checked_attend(self, *args, **kwargs):
        assert not self.offloaded.on_host, "attention read storage on the host"
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(offload_mod.Offload, "_move", copying_move)
    monkeypatch.setattr(TriStateLayer, "_attend_stored", checked_attend)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    budget = dict(budget=16, window=4) if preset == "hfkv" else dict(budget=12, window=4)
    ref = _decode(model, model, hfkv.TriStateCache(model, preset, **budget), ids, new=12)
    cache = hfkv.TriStateCache(model, preset, offloading=True, **budget)
    assert torch.equal(_decode(model, model, cache, ids, new=12), ref)
    layers = cache.compressed_layers()
    # after the last step's attention: on the host, but the first layer, which the last one prefetched (as
    # transformers' Cache.prefetch does: the next step starts there)
    assert [layer.offloaded.on_host for layer in layers] == [False] + [True] * (len(layers) - 1)
    steps = 1 + 12
    for layer in layers:  # out after each step's attention, back before the next one's update
        mine = [d for i, d in moved if i == layer.layer_idx]
        assert mine[: 2 * steps - 1] == ["host", "device"] * (steps - 1) + ["host"]
    cache.reorder_cache(torch.tensor([0]))  # any other entry brings it back first
    assert not any(layer.offloaded.on_host for layer in layers)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_stored_layers_keys_and_values_are_what_it_holds_at_each_position(backend, rotate):
    """``layer.keys`` of a stored layer, for code written for DynamicCache: DynamicCache's ``[B, H, T, D]`` shape
    and dtype, each position as the layer holds it: the window's token as it came, a tier's through that tier's
    format (encoded and decoded, rotated and back), an evicted one zero. Built on each read: the cache's memory
    does not change."""
    from hfkv.quant.rotation import hadamard
    from hfkv.quant.rotation import rotate as rot
    from hfkv.states import EVICTED, MID, QUANTIZED, STATE_LABELS, WINDOW

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 120), generator=torch.Generator().manual_seed(3))
    dyn = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=dyn)  # the prompt's keys do not depend on the cache
    seen = set()
    for budget in (16, 32):  # the first evicts and quantizes, the second keeps every token, some in the mid tier
        cache = hfkv.TriStateCache(model, "hfkv", budget=budget, window=4, backend=backend, rotate=rotate)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        before = cache.stats().kv_bytes
        for mine, ref in zip(cache.layers, dyn.layers, strict=True):
            assert mine.window is not None and not mine.dense.active  # stored, not dense
            states = mine.token_states()
            for got, want, which in ((mine.keys, ref.keys, "key"), (mine.values, ref.values, "value")):
                assert got.shape == want.shape and got.dtype == want.dtype
                h = hadamard(want.shape[-1]) if rotate else None
                stored = rot(want, h) if rotate else want
                for state in states.unique().tolist():
                    at = states == state
                    seen.add(state)
                    if state == EVICTED:
                        expect = torch.zeros_like(want)
                    elif state == WINDOW:
                        expect = want
                    else:
                        fmt = getattr(mine.layouts[state], which)
                        expect = fmt.decode(fmt.encode(stored), torch.float32).to(want.dtype)
                        expect = rot(expect, h) if rotate else expect
                    if rotate and state not in (EVICTED, WINDOW):
                        # Rotating in another shape rounds differently in the last bit: a value on a rounding edge
                        # may take the next step (one token's in 12544 here), never more than the format's error.
                        off = (got[at] - expect[at]).abs()
                        assert (off > 1e-5).float().mean() < 0.01, STATE_LABELS[state]
                        assert off.max() <= (expect[at] - want[at]).abs().max(), STATE_LABELS[state]
                    else:
                        torch.testing.assert_close(
                            got[at], expect[at], atol=1e-5, rtol=1e-5, msg=lambda m, s=state: f"{STATE_LABELS[s]}: {m}"
                        )
        assert cache.stats().kv_bytes == before
    assert {EVICTED, WINDOW, MID, QUANTIZED} <= seen


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_output_attentions_of_a_stored_layer_are_the_weights_its_attention_applied(backend, rotate):
    """``output_attentions=True`` on a layer attending over its tiers: a prompt's weights are eager attention's over
    DynamicCache, bit for bit up to float rounding; a decode step's are the softmax over the held tokens that its
    output is the weighted sum of (the values as held), zero where a token is evicted, summing to one."""
    from hfkv.states import EVICTED

    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    cache = hfkv.TriStateCache(model, "hfkv", budget=16, window=4, backend=backend, rotate=rotate)
    outputs = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: outputs.__setitem__(i, a[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        want = model(input_ids=ids, output_attentions=True, past_key_values=DynamicCache()).attentions
        got = model(input_ids=ids, output_attentions=True, past_key_values=cache).attentions
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        tok = ids[:, -1:]
        for step in range(3):
            att = model(input_ids=tok, output_attentions=True, past_key_values=cache).attentions
            for i, layer in enumerate(cache.layers):
                assert not layer.dense.active
                w, v = att[i], layer.values  # [B, Hq, 1, L], [B, H, L, D] as held
                assert w.shape == (2, model.config.num_attention_heads, 1, 61 + step)
                torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
                g = w.shape[1] // v.shape[1]
                evicted = (layer.token_states() == EVICTED).repeat_interleave(g, 1)[:, :, None, :]
                assert evicted.any() and not w.masked_select(evicted).any()
                mixed = (w @ v.repeat_interleave(g, 1)).transpose(1, 2).reshape(2, 1, -1)
                torch.testing.assert_close(mixed, outputs[i], atol=1e-5, rtol=1e-4)
    for h in hooks:
        h.remove()


def test_attention_weights_of_a_stored_layer_carry_gradients_as_eager_ones_do():
    """transformers' retain_grad check: with grad enabled, a stored layer's output is its weights times the held
    values, so a loss reaches the weights; the logits are those of the no-grad step."""
    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    caches = [hfkv.TriStateCache(model, "quant", backend="cpu") for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, past_key_values=cache)
        want = model(input_ids=ids[:, -1:], past_key_values=caches[0], output_attentions=True).logits
    out = model(input_ids=ids[:, -1:], past_key_values=caches[1], output_attentions=True)
    assert not caches[1].layers[0].dense.active
    for a in out.attentions:
        a.retain_grad()
    out.logits.sum().backward()
    assert all(a.grad is not None and a.grad.abs().sum() > 0 for a in out.attentions)
    torch.testing.assert_close(out.logits.detach(), want, atol=1e-5, rtol=1e-4)
