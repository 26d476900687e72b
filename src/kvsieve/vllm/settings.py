"""What `additional_config={"kvsieve": {...}}` asks of the vLLM plugin, checked before any worker starts.

This module imports no vLLM: the same checks run in the user's process, in the engine core and in
every worker, and the test suite checks them without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..selection.budget import Budget, MaxTokens, Rate, check_count, make_budget, uniform_keep
from ..selection.errors import PolicyError
from ..selection.policy import Policy
from ..selection.spec import make_policy
from ..selection.storage import FULL_STORAGE

#: The key of vLLM's `additional_config` that turns the plugin on.
CONFIG_KEY = "kvsieve"
#: The keys the plugin reads, and what each one is.
KEYS = {
    "policy": "a kvsieve policy spec, e.g. 'snapkv' or 'trimkv:n_recent=64'",
    "rate": "the evicted fraction of each prompt's evictable entries, in [0, 1)",
    "max_tokens": "the entries each request keeps per (layer, kv-head)",
    "buffer": "with max_tokens: re-score and compact every `buffer` new tokens, so generation holds the size",
    "trace": "a file to append one JSON line per engine step to (running, waiting, KV blocks in use)",
}
#: The policy when none is named: kvsieve's best training-free window scorer that vLLM can feed.
DEFAULT_POLICY = "snapkv"


class PluginConfigError(ValueError):
    """The kvsieve entry of vLLM's `additional_config` asks for something the plugin cannot do."""


def unservable(policy: Policy) -> list[str]:
    """Why vLLM cannot serve `policy`: every input it reads that vLLM's attention does not give, and more."""
    needs, why = policy.needs, []
    if needs.reconstruction is not None:
        why.append("a second pass in which the model repeats its prompt (vLLM makes no such pass)")
    if policy.needs_spans:
        why.append(f"the {policy.projection.name} projection's spans, which a vLLM request does not carry")
    if policy.storage != FULL_STORAGE:
        why.append("kvsieve's own storage (kv_bits, kv_codec); vLLM stores entries in --kv-cache-dtype")
    return why


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's settings: the policy, the budget, the buffer of a size held while generating, a trace file."""

    policy: Policy
    budget: Budget
    buffer: int | None = None
    trace: str | None = None

    @classmethod
    def parse(cls, entry: object) -> PluginSettings:
        """The settings of `additional_config["kvsieve"]`, or a `PluginConfigError` that names the problem."""
        if not isinstance(entry, Mapping):
            raise PluginConfigError(f"additional_config['kvsieve'] must be a dict of {sorted(KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(KEYS))
        if unknown:
            known = "; ".join(f"{key}: {what}" for key, what in KEYS.items())
            raise PluginConfigError(f"kvsieve does not know {unknown} in additional_config. It reads {known}")
        try:
            policy = make_policy(str(entry.get("policy", DEFAULT_POLICY)))
            budget = make_budget(entry.get("rate"), entry.get("max_tokens"))
            buffer = entry.get("buffer")
            if buffer is not None:
                check_count("buffer", buffer)
        except (PolicyError, ValueError) as err:
            raise PluginConfigError(f"kvsieve in vLLM: {err}") from None
        why = unservable(policy)
        if why:
            raise PluginConfigError(f"kvsieve cannot serve {policy.name!r} in vLLM: it reads {'; '.join(why)}")
        if not isinstance(budget, (Rate, MaxTokens)):
            raise PluginConfigError("kvsieve in vLLM takes a rate or max_tokens")
        if buffer is not None and not budget.is_size:
            raise PluginConfigError("buffer holds a size while generating: give max_tokens with it, not a rate")
        if buffer is not None:
            try:
                policy = policy.evicting_again()
            except PolicyError as err:
                raise PluginConfigError(f"kvsieve in vLLM: {err}") from None
        return cls(policy, budget, buffer, entry.get("trace"))

    @property
    def bounded(self) -> bool:
        """Whether generation is held at the size (`max_tokens` with `buffer`)."""
        return self.buffer is not None

    @property
    def chunk_policy(self) -> Policy | None:
        """The policy of a prompt prefilled in several chunks, compacted after each (a cache that evicts again: the
        merge its gates' checkpoint may record is left out); None for a policy that names a merge, whose prompts
        are compacted once, after their last chunk."""
        return None if self.policy.names_merge else self.policy.evicting_again()

    def prompt_size(self, prompt: int, shared: int = 0) -> int:
        """Entries per (layer, kv-head) a prompt of `prompt` tokens keeps: `max_tokens`, or what the rate keeps of
        it (its protected entries, a shared prefix of `shared` tokens among them, and the rate's share of the rest),
        the size its chunks are compacted to."""
        if isinstance(self.budget, MaxTokens):
            return self.budget.max_tokens
        protected = min(prompt, max(shared, self.policy.n_sink) + self.policy.n_recent)
        return protected + uniform_keep(prompt - protected, self.budget.rate)
