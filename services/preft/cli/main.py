"""`preft`: run PreFT generation offline (`generate`), a self-contained demo (`demo`), manage a tenant's adapters
on a gateway (`adapters`), serve rollouts to TRL's trainers (`rollout-serve`), and run the platform locally: on this
host (`up`, `down`) or on a testbed of network-namespace hosts (`testbed`)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from preft.cli.rollout import rollout_serve
from preft.cli.tenant import app as adapters_app
from preft.cli.testbed import testbed_app
from preft.common.modes import PositionMode
from preft.engine.requests import REQUEST_KEYS, GenerationRequest, GenerationResult, RequestError, read_requests

if TYPE_CHECKING:
    from preft.stack.local import StackInfo

app = typer.Typer(
    help="preft-serve: many adapters at base-model speed (adapters on prompt tokens only).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(adapters_app, name="adapters")
app.add_typer(testbed_app, name="testbed")
app.command("rollout-serve")(rollout_serve)
err = Console(stderr=True, soft_wrap=True)

ModelOpt = Annotated[Path, typer.Option("--model", help="Model directory (config.json, weights, tokenizer).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | auto")]
MaxLorasOpt = Annotated[int, typer.Option("--max-loras", min=1, help="Adapter slots in the engine.")]
MaxRankOpt = Annotated[int, typer.Option("--max-lora-rank", min=1, help="Largest adapter rank accepted.")]
BatchOpt = Annotated[int | None, typer.Option("--max-num-batched-tokens", min=1, help="Tokens per engine step.")]
LenOpt = Annotated[int | None, typer.Option("--max-model-len", min=1, help="Context length (default: model's).")]


def _engine(model: Path, dtype: str, max_loras: int, max_lora_rank: int, batched: int | None, max_len: int | None):
    from preft.engine.vllm_engine import EngineOptions, PreftEngine

    if not (model / "config.json").is_file():
        err.print(f"[red]error:[/red] {model} is not a model directory (no config.json)")
        raise typer.Exit(2)
    if dtype not in ("float32", "bfloat16", "float16", "auto"):
        err.print(f"[red]error:[/red] --dtype must be float32, bfloat16, float16 or auto, not {dtype!r}")
        raise typer.Exit(2)
    try:
        return PreftEngine(
            EngineOptions(
                model=str(model),
                dtype=dtype,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
            )
        )
    except Exception as e:  # the CLI boundary: vLLM raises many kinds for a model it cannot serve
        err.print(f"[red]error:[/red] cannot start the engine on {model}: {e}")
        raise typer.Exit(2) from None


@app.command()
def generate(
    model: ModelOpt,
    requests: Annotated[Path | None, typer.Option("--requests", help="JSON lines, one request each.")] = None,
    output: Annotated[Path | None, typer.Option("--output", help="JSON lines out (default: stdout).")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", help="A single text prompt instead of --requests.")] = None,
    adapter: Annotated[Path | None, typer.Option("--adapter", help="Adapter directory for --prompt.")] = None,
    mode: Annotated[
        PositionMode, typer.Option("--mode", help="Adapter positions for --prompt.")
    ] = PositionMode.PREFILL,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate for --prompt.")] = 32,
    sampling: Annotated[
        str | None,
        typer.Option(
            "--sampling",
            help='Sampling options as a JSON object, e.g. \'{"temperature": 0.8, "seed": 1, "stop": ["\\n"]}\': '
            "for --prompt, or the default of every request line (its own keys win).",
        ),
    ] = None,
    dtype: DtypeOpt = "auto",
    max_loras: MaxLorasOpt = 4,
    max_lora_rank: MaxRankOpt = 16,
    max_num_batched_tokens: BatchOpt = None,
    max_model_len: LenOpt = None,
) -> None:
    """Generation for every request in one engine, in mixed batches (greedy, EOS ignored, unless asked otherwise).

    Exit code 0: all requests succeeded; 1: some failed (their output lines hold "error"); 2: bad usage.
    """
    if (requests is None) == (prompt is None):
        err.print("[red]error:[/red] give either --requests FILE or --prompt TEXT")
        raise typer.Exit(2)
    try:
        defaults = json.loads(sampling) if sampling is not None else {}
    except ValueError as e:
        err.print(f"[red]error:[/red] --sampling is not JSON: {e}")
        raise typer.Exit(2) from None
    if not isinstance(defaults, dict) or set(defaults) & set(REQUEST_KEYS):
        err.print(
            f"[red]error:[/red] --sampling must be a JSON object of sampling options (not {', '.join(REQUEST_KEYS)})"
        )
        raise typer.Exit(2)
    if requests is not None:
        try:
            lines = requests.read_text().splitlines()
        except OSError as e:
            err.print(f"[red]error:[/red] cannot read {requests}: {e.strerror}")
            raise typer.Exit(2) from None
        reqs, failed = read_requests(lines, defaults)
    else:
        try:
            reqs = [
                GenerationRequest.from_json(
                    defaults
                    | {
                        "id": "prompt",
                        "prompt": prompt,
                        "mode": mode.value,
                        "adapter": str(adapter) if adapter else None,
                        "max_tokens": max_tokens,
                    }
                )
            ]
        except RequestError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        failed = []
    engine = _engine(model, dtype, max_loras, max_lora_rank, max_num_batched_tokens, max_model_len)
    results: list[GenerationResult] = [*engine.generate(reqs), *failed] if reqs else failed
    text = "".join(json.dumps(r.to_json()) + "\n" for r in results)
    if output is not None:
        output.write_text(text)
    else:
        sys.stdout.write(text)
    bad = [r for r in results if r.error]
    for r in bad:
        err.print(f"[yellow]request {r.id} failed:[/yellow] {r.error}")
    err.print(f"{len(results) - len(bad)} of {len(results)} requests succeeded")
    engine.close()
    raise typer.Exit(1 if bad else 0)


StateDirOpt = Annotated[Path, typer.Option("--state-dir", help="Where the local stack keeps its state and logs.")]
DEFAULT_STATE_DIR = Path(".preft/stack")


def _pasteable(path: Path, cwd: Path) -> str:
    """`path` as a shell word that works pasted in `cwd`: relative when under it (`.venv/bin/preft`), else absolute."""
    path = Path(os.path.abspath(path))  # (not resolve(): a venv's python is a symlink out of the venv)
    with contextlib.suppress(ValueError):
        return shlex.quote(str(path.relative_to(cwd)))
    return shlex.quote(str(path))


def _commands(executable: Path, cwd: Path) -> tuple[str, str, str]:
    """How to run this environment's python, `preft` and `preft-admin` from `cwd`: the scripts beside the running
    interpreter (a venv's bin/), since that directory is rarely on PATH and the system python lacks our packages."""
    python = _pasteable(executable, cwd)
    scripts = [executable.parent / name for name in ("preft", "preft-admin")]
    preft, admin = (
        _pasteable(path, cwd) if path.is_file() else f"{python} -m preft.cli.{module}"
        for path, module in zip(scripts, ("main", "admin"), strict=True)
    )
    return python, preft, admin


def up_message(
    info: StackInfo, demo: dict, state_dir: Path, *, executable: Path, cwd: Path, already_running: bool = False
) -> str:
    """What `preft up` prints on stdout: where the stack is, and commands that work pasted as printed in `cwd`."""
    python, preft, admin = _commands(executable, cwd)
    key, url = demo["api_key"], info.gateway_url
    lora = _pasteable(state_dir / "adapters" / "lora", cwd)
    state, model = _pasteable(state_dir, cwd), _pasteable(Path(info.model_dir), cwd)
    # preft-admin looks in .preft/stack by default; another state directory must be named to it.
    on_default = Path(os.path.abspath(state_dir)) == cwd / DEFAULT_STATE_DIR
    admin_env = "" if on_default else f"PREFT_ADMIN__STACK_DIR={state} "
    status = "is already running" if already_running else "is up"
    return f"""preft-serve {status}: gateway {url}, registry {info.registry_address}, engine {info.engine_url}
demo tenant {demo["tenant"]!r}, adapters {", ".join(demo["adapters"])}; stop with `{preft} down`.

NOTE: the engine serves a tiny randomly initialised model generated for this demo ({model}): its
outputs are noise. It shows the platform working (keys, adapters, routing), not a model. A real model directory
(config.json, weights, tokenizer), with an adapter trained for that model, runs offline with
  {preft} generate --model MODEL_DIR --prompt 'hello' --adapter ADAPTER_DIR --mode prefill
and is served by the Kubernetes manifests in deploy/ and helm/ (docs/deploy.md).

curl {url}/v1/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "demo-lora", "prompt": "the adapter serves a prompt", "max_tokens": 16}}'

curl -N {url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "demo-direft", "messages": [{{"role": "user", "content": "hello world"}}], "stream": true}}'

# a tenant uploads its own adapter (here the demo LoRA again, as "my-lora"), then serves it by name
curl {url}/v1/adapters -H "Authorization: Bearer {key}" -F name=my-lora -F alias=prod \\
  -F files=@{lora}/adapter_config.json -F files=@{lora}/adapter_model.safetensors
# the same from the command line (also list, show, alias, share, delete)
PREFT_BASE_URL={url} PREFT_API_KEY={key} {preft} adapters upload my-lora {lora}

# the operator: preft-admin finds this stack's registry and admin token in {state}/stack.json and
# {state}/secrets.json (owner-only) by itself; --token or PREFT_ADMIN__TOKEN overrides them
{admin_env}{admin} tenant list

{python} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{key}")
print(client.completions.create(model="demo-lora", prompt="the adapter serves a prompt", max_tokens=16).choices[0].text)
chat = client.chat.completions.create(model="demo-direft", messages=[{{"role": "user", "content": "hello"}}])
print(chat.choices[0].message.content)
print(client.responses.create(model="demo-lora", input="hello", max_output_tokens=16).output_text)
PY
"""


@app.command()
def up(state_dir: StateDirOpt = DEFAULT_STATE_DIR) -> None:
    """Start the local platform (Redis, S3, registry, Ray Serve engine, gateway) and print how to call it."""
    from preft.common.loopback import ServerError
    from preft.stack import control

    info = control.running(state_dir)
    already_running = info is not None
    if info is not None:
        err.print(f"the local stack in {state_dir} is already running (supervisor pid {info.pid})")
    else:
        err.print(f"starting the local stack in {state_dir} (first start: ~1-2 min) ...")
        try:
            info = control.start(state_dir)
        except ServerError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
    demo = json.loads((state_dir / "demo.json").read_text())
    exe, cwd = Path(sys.executable), Path.cwd()
    sys.stdout.write(up_message(info, demo, state_dir, executable=exe, cwd=cwd, already_running=already_running))


@app.command()
def down(state_dir: StateDirOpt = Path(".preft/stack")) -> None:
    """Stop the local platform; its state (adapters, tenants, keys) stays for the next `preft up`."""
    from preft.stack import control

    if control.stop(state_dir):
        err.print("stopped")
    else:
        err.print("no local stack is running")


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option("--workdir", help="Where the generated model and adapters go.")] = Path(
        ".preft/demo"
    ),
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 12,
) -> None:
    """Generate a tiny model, a LoRA and a DiReFT adapter, and show base / prefill / all outputs side by side."""
    from preft.devtools.tiny import TinyModelSpec, build_direft, build_lora, build_model
    from preft.engine.vllm_engine import EngineOptions, PreftEngine

    model = workdir / "model"
    if not (model / "config.json").is_file():
        build_model(model, TinyModelSpec())
    ads = {"lora": build_lora(workdir / "lora", model), "direft": build_direft(workdir / "direft", model)}
    prompt = "the adapter serves a prompt for the tenant and the engine decodes"
    reqs = [GenerationRequest("base", prompt=prompt, max_tokens=max_tokens)]
    for name, path in ads.items():
        for m in PositionMode:
            reqs.append(
                GenerationRequest(f"{name}/{m.value}", prompt=prompt, adapter=str(path), mode=m, max_tokens=max_tokens)
            )
    engine = PreftEngine(EngineOptions(model=str(model), dtype="float32", max_loras=2, max_lora_rank=16))
    results = engine.generate(reqs)
    engine.close()
    table = Table(title=f"preft demo: one engine, one mixed batch — prompt: {prompt!r}")
    for col in ("adapter / mode", "first tokens", "text"):
        table.add_column(col)
    for r in results:
        table.add_row(r.id, " ".join(map(str, r.token_ids[:8])), repr(r.text))
    Console().print(table)
    Console().print(
        "prefill and all share the first token (both compute the prompt with the adapter); after it, prefill\n"
        "decodes with the base model while all keeps the adapter. Try it yourself:\n"
        f"  .venv/bin/preft generate --model {model} --prompt 'hello world' --adapter {ads['direft']} --mode prefill"
    )


if __name__ == "__main__":
    app()
