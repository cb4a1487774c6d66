"""A teacher-forced causal LM: a real architecture whose next token follows a script (tests/families.py).

Copied into each test family's model dir and named in its config.json ``auto_map``, so ``AutoModelForCausalLM``
loads it with ``trust_remote_code=True`` (as a user's custom-code model loads). The network runs as it is; only
the last position's logits are replaced where the ids so far end with a script prompt and a prefix of its
completion: the completion's next token gets all the mass (so greedy and sampled decoding both follow it). The
script is ``forced.json`` beside config.json, read again when its mtime changes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import GptOssForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class _Forced:
    _script: list[tuple[list[int], list[int]]] | None = None
    _mtime: float = -1.0
    _seen: Any = None

    def _load_script(self) -> list[tuple[list[int], list[int]]]:
        path = os.path.join(str(self.config._name_or_path), "forced.json")
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            return []
        if mtime != self._mtime:
            with open(path, encoding="utf-8") as f:
                self._script = [(list(p), list(c)) for p, c in json.load(f)]
            self._mtime = mtime
        return self._script or []

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.register_forward_hook(self._force)

    def next_token(self, row: list[int]) -> int | None:
        for prompt, completion in self._load_script():
            n = len(prompt)
            for k in range(len(completion)):
                if (
                    len(row) >= n + k
                    and row[len(row) - n - k : len(row) - k] == prompt
                    and (k == 0 or row[len(row) - k :] == completion[:k])
                ):
                    return completion[k]
        return None

    def prepare_inputs_for_generation(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen = input_ids
        return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)

    def _force(self, module: Any, args: Any, out: Any) -> Any:
        """A forward hook (the forward's own signature stays the architecture's, which generate checks)."""
        seen = self._seen  # set by generate only: a training forward is the network's own
        if seen is None or getattr(out, "logits", None) is None:
            return out
        logits = out.logits
        for r, row in enumerate(seen.tolist()):
            tok = self.next_token(row)
            if tok is not None:
                forced = torch.full_like(logits[r, -1], float("-inf"))
                forced[tok] = 0.0
                logits[r, -1] = forced
        self._seen = None
        return out


class ForcedQwen2ForCausalLM(_Forced, Qwen2ForCausalLM):
    pass


class ForcedQwen3ForCausalLM(_Forced, Qwen3ForCausalLM):
    pass


class ForcedLlamaForCausalLM(_Forced, LlamaForCausalLM):
    pass


class ForcedGptOssForCausalLM(_Forced, GptOssForCausalLM):
    pass
