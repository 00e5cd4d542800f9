"""What a trial measures: quality of a config against the full cache, and the KV memory it holds.

``fidelity`` needs no labels (the model's own full-cache predictions are the reference), so it
works for any model; the reference solutions are teacher-forced through the cache one token per
forward, as ``generate`` feeds them, so decode-time compression is what is measured. ``accuracy``
is the end task: generate, take the last ``\\boxed{}``, compare with math-verify. Both report
memory as bytes held / what a DynamicCache holds, summed over the problems.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hfkv import TriStateCache
from hfkv.calibration.answers import answers_match, last_boxed, solution_answer
from hfkv.calibration.data import Problem
from hfkv.config import TriStateConfig
from hfkv.evaluation.fidelity import mean_fidelity, reference_logprobs, teacher_forced
from hfkv.storage import cache_bytes

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_FORMATS = ("auto", "chat", "plain")

# Metric -> (objective, optimisation direction).
METRICS: dict[str, tuple[str, str]] = {
    "kl": ("fidelity", "minimize"),
    "top1": ("fidelity", "maximize"),
    "accuracy": ("accuracy", "maximize"),
}
OBJECTIVES = ("fidelity", "accuracy")
DEFAULT_METRIC = {"fidelity": "kl", "accuracy": "accuracy"}

# Worked examples for few-shot prompts of base models (written for hfkv, not taken from MATH).
EXEMPLARS: tuple[tuple[str, str], ...] = (
    (
        "What is the value of $3^2 + 4^2$?",
        "We have $3^2 = 9$ and $4^2 = 16$, so the sum is $9 + 16 = 25$. The answer is $\\boxed{25}$.",
    ),
    (
        "Solve for $x$: $2x - 7 = 11$.",
        "Adding 7 to both sides gives $2x = 18$, and dividing by 2 gives $x = 9$. The answer is $\\boxed{9}$.",
    ),
    (
        "How many positive divisors does $12$ have?",
        "Since $12 = 2^2 \\cdot 3$, it has $(2+1)(1+1) = 6$ positive divisors. The answer is $\\boxed{6}$.",
    ),
    (
        "A fair coin is flipped twice. What is the probability of getting two heads?",
        "Each flip is heads with probability $\\frac12$, independently, so the probability is "
        "$\\frac12 \\cdot \\frac12 = \\boxed{\\frac{1}{4}}$.",
    ),
)


def prompt_text(tok, problem: str, fmt: str = "auto", n_shots: int = 0) -> str:
    """The problem as the model expects it: its chat template, or ``Problem: / Solution:`` text with
    ``n_shots`` worked examples (for base models without a chat template)."""
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"--prompt={fmt!r} must be one of {PROMPT_FORMATS}")
    if not 0 <= n_shots <= len(EXEMPLARS):
        raise ValueError(f"--n-shots={n_shots} must be in [0, {len(EXEMPLARS)}]")
    if fmt == "auto":
        fmt = "chat" if getattr(tok, "chat_template", None) else "plain"
    if fmt == "chat":
        if not getattr(tok, "chat_template", None):
            raise ValueError("--prompt chat: this tokenizer has no chat template; use --prompt plain")
        messages = []
        for q, a in EXEMPLARS[:n_shots]:
            messages += [{"role": "user", "content": f"{q}\n{INSTRUCTION}"}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": f"{problem}\n{INSTRUCTION}"})
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    shots = "".join(f"Problem:\n{q}\n\nSolution:\n{a}\n\n" for q, a in EXEMPLARS[:n_shots])
    return f"{shots}Problem:\n{problem}\n\nSolution:\n"


@dataclass
class Encoded:
    ids: torch.Tensor  # [1, T]: prompt tokens then solution tokens
    prompt_len: int


def encode(
    tok,
    problems: Sequence[Problem],
    fmt: str,
    n_shots: int,
    max_solution_tokens: int | None,
    solutions: Sequence[Sequence[int]] | None = None,
) -> list[Encoded]:
    """Prompt and solution tokenised separately and concatenated: the ids ``generate`` would have
    produced had the model written the reference solution (no merge across the boundary). With
    ``solutions`` (token ids per problem, e.g. the model's own greedy ones: :func:`generate_solutions`)
    those are the continuation instead of the data's reference solutions."""
    if solutions is not None and len(solutions) != len(problems):
        raise ValueError(f"{len(solutions)} solutions for {len(problems)} problems")
    out = []
    for i, p in enumerate(problems):
        prompt = tok(prompt_text(tok, p.problem, fmt, n_shots), add_special_tokens=False).input_ids
        if not prompt:
            raise ValueError("the prompt encodes to no tokens")
        sol = list(solutions[i]) if solutions is not None else tok(p.solution, add_special_tokens=False).input_ids
        if max_solution_tokens:
            sol = sol[:max_solution_tokens]
        if not sol:
            raise ValueError(f"a solution encodes to no tokens: {p.solution[:60]!r}")
        out.append(Encoded(torch.tensor([prompt + sol]), len(prompt)))
    return out


@torch.inference_mode()
def generate_solutions(
    model,
    tok,
    problems: Sequence[Problem],
    max_new_tokens: int,
    fmt: str = "auto",
    n_shots: int = 0,
    progress: bool = False,
) -> list[list[int]]:
    """The model's own greedy solutions, one problem at a time with the full cache (``DynamicCache``):
    at most ``max_new_tokens`` token ids each (the end-of-sequence token included when it stops there).
    The prompt is the one :func:`encode` builds, so prompt + solution is what ``generate`` produced."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = []
    for p in _progress(problems, "generating solutions", progress):
        text = prompt_text(tok, p.problem, fmt, n_shots)
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids], device=model.device)
        plain = fmt == "plain" or (fmt == "auto" and not getattr(tok, "chat_template", None))
        kwargs = {"stop_strings": ["\nProblem:"], "tokenizer": tok} if plain else {}
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **kwargs,
        )
        sol = [int(t) for t in gen[0, ids.shape[1] :].tolist()]
        while len(sol) > 1 and pad is not None and sol[-1] == pad and pad != tok.eos_token_id:
            sol.pop()
        out.append(sol[:max_new_tokens])
    return out


@dataclass
class Evaluation:
    """One config on a problem set. ``quality`` holds the metrics (kl/top1 or accuracy)."""

    quality: dict[str, float]
    kv_bytes: int
    dense_bytes: int
    n: int

    @property
    def memory_ratio(self) -> float:
        return self.kv_bytes / self.dense_bytes if self.dense_bytes else float("nan")

    def to_dict(self) -> dict:
        return {
            **self.quality,
            "memory_ratio": self.memory_ratio,
            "kv_bytes": self.kv_bytes,
            "dense_bytes": self.dense_bytes,
            "n": self.n,
        }


def _progress(items, desc: str, enabled: bool):
    return tqdm(items, desc=desc, leave=False, disable=not enabled, unit="problem")


class FidelityObjective:
    """Mean KL divergence and top-1 agreement of next-token distributions, compressed vs full cache.

    The full-cache log-probs of every problem are computed once per process and reused by every
    trial (``reference_logprobs``: the same forwards and chunking as the compressed run, so the
    ``full`` preset scores exactly 0 KL and 1.0 agreement).
    """

    name = "fidelity"
    metrics = ("kl", "top1")

    def __init__(
        self,
        model,
        tok,
        problems: Sequence[Problem],
        chunk: int = 1,
        max_solution_tokens: int | None = None,
        prompt: str = "auto",
        n_shots: int = 0,
        solutions: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"--chunk={chunk} must be >= 1")
        self.model, self.chunk = model, chunk
        self.items = encode(tok, problems, prompt, n_shots, max_solution_tokens, solutions)
        self._refs: list[torch.Tensor] | None = None

    def longest(self) -> int:
        """Tokens of the longest sequence: a budget this large keeps everything."""
        return max(int(it.ids.shape[1]) for it in self.items)

    def references(self, progress: bool = False) -> list[torch.Tensor]:
        if self._refs is None:
            self._refs = [
                reference_logprobs(self.model, it.ids, it.prompt_len, self.chunk)
                for it in _progress(self.items, "full-cache reference", progress)
            ]
        return self._refs

    def evaluate(self, cfg: TriStateConfig, progress: bool = False, on_problem=None) -> Evaluation:
        """``on_problem(index, running)``, if given, is called after each problem with the evaluation of
        the problems so far (a pruner's intermediate value; it may raise to stop the evaluation)."""
        refs = self.references(progress)
        results = []

        def running() -> Evaluation:
            m = mean_fidelity(results)
            return Evaluation({"kl": m.kl, "top1": m.top1}, m.kv_bytes, m.dense_bytes, len(results))

        for i, (it, ref) in enumerate(zip(_progress(self.items, f"{cfg.name}", progress), refs, strict=False)):
            fid, _ = teacher_forced(
                self.model, it.ids, it.prompt_len, lambda: TriStateCache(self.model, cfg), ref, self.chunk
            )
            results.append(fid)
            if on_problem is not None:
                on_problem(i, running())
        return running()


class AccuracyObjective:
    """Greedy generation; the last ``\\boxed{}`` of the output against the reference solution's."""

    name = "accuracy"
    metrics = ("accuracy",)

    def __init__(
        self,
        model,
        tok,
        problems: Sequence[Problem],
        max_new_tokens: int = 512,
        batch_size: int = 1,
        prompt: str = "auto",
        n_shots: int = 0,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={max_new_tokens} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"--batch-size={batch_size} must be >= 1")
        self.model, self.tok = model, tok
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.prompts = [prompt_text(tok, p.problem, prompt, n_shots) for p in problems]
        self.gold = [solution_answer(p.solution) for p in problems]
        self.plain = "Problem:\n" in self.prompts[0] and not getattr(tok, "chat_template", None)
        self.last_outputs: list[str] = []

    def longest(self) -> int:
        """Tokens of the longest prompt plus the generation length: a budget this large keeps everything."""
        return max(len(self.tok(p, add_special_tokens=False).input_ids) for p in self.prompts) + self.max_new_tokens

    @torch.inference_mode()
    def evaluate(self, cfg: TriStateConfig, progress: bool = False, on_problem=None) -> Evaluation:
        """``on_problem(index, running)`` as for :meth:`FidelityObjective.evaluate`, after each batch (the
        index of its last problem)."""
        correct, kv, dense, outputs = 0, 0, 0, []
        batches = [
            range(i, min(i + self.batch_size, len(self.prompts))) for i in range(0, len(self.prompts), self.batch_size)
        ]
        for idx in _progress(batches, cfg.name, progress):
            enc = self.tok([self.prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(self.model.device)
            cache = TriStateCache(self.model, cfg)
            kwargs = {"stop_strings": ["\nProblem:"], "tokenizer": self.tok} if self.plain else {}
            out = self.model.generate(
                **enc,
                past_key_values=cache,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.tok.pad_token_id,
                **kwargs,
            )
            st = cache.stats()
            kv += cache_bytes(cache)
            dense += st.dense_bytes
            for row, i in enumerate(idx):
                text = self.tok.decode(out[row, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                outputs.append(text)
                correct += answers_match(last_boxed(text), self.gold[i])
            if on_problem is not None:
                on_problem(idx[-1], Evaluation({"accuracy": correct / len(outputs)}, kv, dense, len(outputs)))
        self.last_outputs = outputs
        return Evaluation({"accuracy": correct / len(self.prompts)}, kv, dense, len(self.prompts))
