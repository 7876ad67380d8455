"""What `python -m kforge` and `python -m kforge.bench` share: the --model factory contract, progress
bars only on a terminal, -v logging, and a quiet exit when the reader of stdout goes away."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

# The contract of `--model package.module:factory`, shown in every verb's --help. `keywords` differ
# per command: each offers what it has (tie-outs have no autocast keyword, benchmarks no device).
FACTORY_CONTRACT = """\
--model package.module:factory: your own model. factory is any callable returning (model, inputs)
or (model, inputs, options):
  keywords  it is called with those of {keywords}
            that its signature names (or all, given **kwargs); {keywords_note}
  model     a torch.nn.Module; deterministic (no active dropout){model_note}
  inputs    one tensor, a tuple of positional arguments, or a dict of keyword arguments
  options   optional dict: "mode" ("jit": thunder.jit, the default; "dynamo": torch.compile with
            Thunder as backend), "loss_fn" (output -> scalar to backpropagate; default: an output
            named `loss`, else the first scalar output, else a fixed random projection), "autocast"
            (a dtype: the step runs under torch.autocast)
e.g. --model kforge.zoo.plain_llama:make"""


def factory_contract(keywords: Sequence[str], keywords_note: str, model_note: str = "") -> str:
    """FACTORY_CONTRACT for a command offering `keywords` to the factory; `keywords_note` says where
    their values come from, `model_note` what the command does to the model it gets."""
    return FACTORY_CONTRACT.format(keywords=", ".join(keywords), keywords_note=keywords_note,
                                   model_note=model_note)


def progress_enabled() -> bool:
    """Progress bars only on a terminal: in a log, tqdm's carriage-return frames are noise."""
    return sys.stderr.isatty()


def setup_logging(verbosity: int) -> None:
    """-v: kforge's INFO messages (NVRTC loaded, compile times) on stderr; -vv: DEBUG (cache hits)."""
    if verbosity <= 0:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    log = logging.getLogger("kforge")
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)


def run(main: Callable[[], int]) -> int:
    """`main()`'s exit status; when stdout's reader has gone (`python -m kforge demo | head`), exit
    quietly with 141 (128 + SIGPIPE, what a shell reports for other tools) rather than a traceback."""
    try:
        try:
            return main()
        finally:  # also after argparse's SystemExit (--help): a closed pipe fails here, not at shutdown
            sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
