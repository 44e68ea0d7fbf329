"""The `strata` command: `strata generate ...` (more subcommands come with the engine process and the server)."""

from __future__ import annotations

import json
import sys
import time

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict

from strata.config import EngineSettings, GenerateSettings, use_config_file
from strata.errors import StrataError


def _prompt_ids(s: GenerateSettings, tokenizer) -> list[int]:
    if s.prompt_ids is not None:
        if s.prompt is not None:
            raise StrataError("give either --prompt or --prompt-ids, not both")
        try:
            return [int(t) for t in s.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise StrataError(f"--prompt-ids {s.prompt_ids!r}: expected integers separated by spaces") from None
    if s.prompt is None:
        raise StrataError("nothing to generate from: give --prompt TEXT or --prompt-ids \"1 2 3\"")
    if tokenizer is None:
        raise StrataError(f"{s.model}: the checkpoint has no tokenizer; give --prompt-ids instead of --prompt")
    if s.chat:
        return tokenizer.encode_chat([{"role": "user", "content": s.prompt}])
    return tokenizer.encode(s.prompt)


def run_generate(s: GenerateSettings) -> None:
    from strata.runtime.generate import Engine
    from strata.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed)
    params.validate()
    start = time.perf_counter()
    files = s.open_model()
    prompt = _prompt_ids(s, files.tokenizer)
    engine = Engine(files, device=s.torch_device(), dtype=s.torch_dtype(), max_cells=s.max_cells,
                    max_window_tokens=s.max_window_tokens, kernels=s.kernels, cuda_graphs=s.cuda_graphs,
                    **s.stage_options())
    engine.check_prompt(prompt)
    loaded = time.perf_counter()
    tok = files.tokenizer
    if s.json:
        gen = engine.generate(prompt, s.max_tokens, params)
        text = tok.decode(gen.ids, skip_special_tokens=True) if tok else None
        print(json.dumps({"prompt_ids": prompt, "ids": gen.ids, "text": text, "finish_reason": gen.finish_reason}))
        return
    count, reason = 0, "length"
    for token, reason in engine.stream(prompt, s.max_tokens, params) if s.max_tokens else ():
        count += 1
        piece = tok.decode([token], skip_special_tokens=True) if tok else f"{token} "
        sys.stdout.write(piece)
        sys.stdout.flush()
    done = time.perf_counter()
    print()
    print(f"[{count} tokens, {reason}; load {loaded - start:.2f} s, {count / max(done - loaded, 1e-9):.1f} tokens/s]",
          file=sys.stderr)


class Generate(GenerateSettings):
    """Generate text from a prompt with one model on one device."""

    def cli_cmd(self) -> None:
        run_generate(self)


def _packed_workers(files, s: EngineSettings) -> dict:
    """For the compile workers of an engine that keeps weights packed on a GPU: what it packs (the workers'
    random weights copy it) and its weights' packed size (the room left beside them); {} otherwise."""
    if s.torch_device().type != "cuda" or s.kernels == "torch" or s.dequantize_weights:
        return {}
    try:
        from autoconfig.facts import read_model

        size = s.torch_dtype().itemsize
        return dict(plan=files.packed_plan(s.torch_dtype()),
                    model_bytes=read_model(files, bytes_per_param=size, packed=True).weight_bytes)
    except Exception as e:  # noqa: BLE001 - only the workers' coverage depends on it
        import logging

        logging.getLogger("strata.engine").warning(
            "the compile workers will not compile the packed kernels ahead (the warm-up will): %s", e)
        return {}


def run_engine(s: EngineSettings) -> None:
    from strata.runtime.generate import Engine, default_window_tokens
    from strata.runtime.pipe import Pipe
    from strata.runtime.precompile import start_compile_workers
    from strata.runtime.scheduler import Scheduler

    import logging

    from strata.runtime.warmup import warm_up

    from strata.runtime.pipe import exit_with_parent

    exit_with_parent()  # started by `strata serve`: never outlive it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    files = s.open_model()
    workers = start_compile_workers(
        files.spec, device=s.torch_device(), dtype=s.torch_dtype(), kernels=s.kernels, max_cells=s.max_cells,
        max_window_tokens=s.max_window_tokens or default_window_tokens(s.torch_device()), num_slots=s.batch,
        lookahead=s.lookahead, single_stage=s.layer_split is None and s.expert_budget_gb is None,
        workers=s.compile_workers,
        **_packed_workers(files, s))
    engine = Engine(files, device=s.torch_device(), dtype=s.torch_dtype(), max_cells=s.max_cells,
                    max_window_tokens=s.max_window_tokens, kernels=s.kernels, cuda_graphs=s.cuda_graphs,
                    park_gb=s.park_gb, park_dir=s.park_dir, park_disk_gb=s.park_disk_gb, **s.stage_options())
    loaded = time.perf_counter()
    logging.getLogger("strata.engine").info("model loaded in %.1f s", loaded - start)
    if workers is not None:
        workers.wait()  # before the slots' cells are allocated: the workers' memory is free again
    pipe = Pipe(sys.stdin, sys.stdout)
    scheduler = Scheduler(engine, s.batch, pipe.emit, s.max_waiting)
    warm_up(scheduler.slots)  # before READY: nothing is compiled or captured on a request's path
    pipe.serve(scheduler)


class EngineCommand(EngineSettings):
    """Run the engine process: commands on stdin, events on stdout, one line each (docs/PROTOCOL.md)."""

    def cli_cmd(self) -> None:
        run_engine(self)


def _serve_settings():
    from serve.config import ServeSettings

    class Serve(ServeSettings):
        """Run the OpenAI-compatible HTTP server (it starts and owns the engine process)."""

        def cli_cmd(self) -> None:
            import logging

            from serve.app import create_app
            from serve.shutdown import serve

            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            app = create_app(self)
            serve(app, self.host, self.port, app.state.drain)

    return Serve


class Strata(BaseSettings):
    """Strata: an inference engine for large Mixture-of-Experts language models."""

    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True, cli_prog_name="strata")
    generate: CliSubCommand[Generate]
    engine: CliSubCommand[EngineCommand]
    serve: CliSubCommand[_serve_settings()]  # type: ignore[valid-type]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def _take_config(argv: list[str]) -> list[str]:
    """Pull `--config FILE` out of argv (it names where the other settings come from)."""
    out, it = [], iter(argv)
    for arg in it:
        if arg == "--config":
            use_config_file(next(it, None) or "")
        elif arg.startswith("--config="):
            use_config_file(arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        field = "--" + str(err["loc"][-1]).replace("_", "-") if err["loc"] else "input"
        parts.append(f"{field}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["autoconfig"]:  # its own parser: it also has the `facts` subcommand
        from autoconfig.cli import main as autoconfig_main

        return autoconfig_main(argv[1:])
    try:
        CliApp.run(Strata, cli_args=_take_config(argv))
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"strata: error: {_explain(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
