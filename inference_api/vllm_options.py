"""vLLM's options that a command line copied from vLLM carries and this server's parser does not take.

A deployment moved from vLLM keeps its command line (a Kubernetes manifest's args, a compose file's
command). Most of vLLM's options have this server's equivalent under both names (`--max-model-len`,
`--max-num-seqs`, `--enforce-eager`, `--generation-config`; __main__.py). These are the rest: one
device's parallelism, which is what this server runs (more devices: more servers behind the proxy),
taken at 1 with no effect; and two refused with what to do instead, where going on without them would
not be what the operator asked for: a server open to anyone, or a cache sized some other way.
"""

from __future__ import annotations

# Parallelism across devices: a server here runs its model on one device (docs/deploy.md scales out).
ONE_DEVICE = (
    *("--tensor-parallel-size", "-tp"),
    *("--pipeline-parallel-size", "-pp"),
    *("--data-parallel-size", "-dp"),
)
REFUSED = {
    "--api-key": "this server checks no key itself: the proxy in front of it checks each team's JWT "
    "(`make token`, docs/proxy.md); leave it out, and keep the server on its internal address",
    "--gpu-memory-utilization": "the KV cache is sized here by --kv-cache-memory SIZE (or by "
    "--max-seq-len), not by a share of the device's memory; the start-up log gives its size",
}


class VllmOptionError(ValueError):
    """A vLLM option this server does not take, and what to do instead."""


def without_vllm_options(argv: list[str]) -> list[str]:
    """`argv` without the parallelism options at 1 (`--tensor-parallel-size 1` or `=1`); VllmOptionError for
    one over 1 and for the refused options."""
    kept: list[str] = []
    arguments = iter(argv)
    for argument in arguments:
        name, equals, value = argument.partition("=")
        if name in REFUSED:
            raise VllmOptionError(f"{name} is vLLM's option, not taken: {REFUSED[name]}")
        if name not in ONE_DEVICE:
            kept.append(argument)
            continue
        if not equals:
            value = next(arguments, "")
        if value != "1":
            raise VllmOptionError(
                f"{name} {value}: a server runs its model on one device; for more, run a server a device "
                "(--device cuda:N) behind the proxy, which spreads the requests (docs/deploy.md)"
            )
    return kept
