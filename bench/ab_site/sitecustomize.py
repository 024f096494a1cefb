"""Two variants of our server in one `bench_peers.py` run (the VM's speed drifts by 10-20 % over minutes, so
only sides measured in the same alternating rounds compare). Put this folder on PYTHONPATH and list two dtypes
that load alike, e.g. TINYSERVE_DTYPES="default float32" on a CPU where auto is float32: the server started with
TINYSERVE_DTYPE=$AB_SIDE_DTYPE gets AB_MODE, the other is today's server.

    AB_MODE=no_prompt_pass  the prompts' pass stays eager (server/execution/decoder/prompt_pass.py)
    AB_MODE=int8            TINYSERVE_WEIGHTS=int8 (int8 against the default dtype in the same rounds)
    AB_MODE=whole_only      every decode bucket one whole frozen graph, no regional ones (server/execution/compiler.py)
    AB_MODE=one_bucket      only the one-row decode bucket and the prompts' pass built (TINYSERVE_COMPILE_MAX_BATCH=1)
    AB_MODE=one_step        a schedule every decode step (TINYSERVE_STEPS_PER_SCHEDULE=1)
"""

import os

if os.environ.get("AB_SIDE_DTYPE") and os.environ.get("TINYSERVE_DTYPE") == os.environ["AB_SIDE_DTYPE"]:
    mode = os.environ.get("AB_MODE", "")
    if mode == "no_prompt_pass":
        import server.execution.decoder.prompt_pass as prompt_pass

        prompt_pass.PromptPass.buckets = lambda self: []
    elif mode == "int8":
        os.environ["TINYSERVE_WEIGHTS"] = "int8"
    elif mode == "one_bucket":
        os.environ["TINYSERVE_COMPILE_MAX_BATCH"] = "1"
    elif mode == "one_step":
        os.environ["TINYSERVE_STEPS_PER_SCHEDULE"] = "1"
    elif mode == "whole_only":
        from server.execution.decoder.runner import GPTRunner

        passes = GPTRunner.compile_passes

        def whole_only(self, max_rows: int) -> list:  # each bucket once, frozen, as before the regional builds
            return [p for p in passes(self, max_rows) if not p.regional]

        GPTRunner.compile_passes = whole_only
    else:
        raise SystemExit(f"AB_MODE: unknown mode {mode!r} (no_prompt_pass, int8, whole_only, one_bucket, one_step)")
