"""The ``kiln`` command line: generate, serve, bench, profile, eval, quantize, zoo."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.cli_options import HELP_OPTIONS, engine_options
from kiln.zoo import DEFAULT_MODEL

if TYPE_CHECKING:  # (imported where used, so that `kiln --help` starts fast)
    from kiln.batch_io import PromptInput
    from kiln.engine.llm_engine import LLMEngine
    from kiln.outputs import RequestOutput
    from kiln.sampling.params import SamplingParams, StructuredOutputsParams


def _load(name: str, module: str, attr: str) -> click.Command:
    import importlib

    import typer

    command = getattr(importlib.import_module(module), attr)
    if not isinstance(command, typer.Typer):
        return command
    # typer vendors its own click: its commands raise exceptions plain click does not handle,
    # so the app runs in its own standalone mode behind a pass-through click command
    app = command
    help_text = (app.info.help or "").strip()

    @click.command(name, help=help_text, short_help=help_text.split("\n")[0],
                   add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def run_typer_app(ctx: click.Context) -> None:
        app(args=ctx.args, prog_name=f"kiln {name}")

    return run_typer_app


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or help lists it), so
    `kiln bench` needs no web-server packages and `kiln generate` starts fast."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *SUBCOMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in SUBCOMMANDS:
            return _load(name, *SUBCOMMANDS[name])
        return super().get_command(ctx, name)


# command name -> (module, attribute): click commands/groups or typer apps of each package
SUBCOMMANDS = {
    "zoo": ("kiln.zoo.cli", "zoo_app"),
    "eval": ("kiln.eval", "eval_app"),
    "serve": ("kiln.serve.cli", "serve_command"),
    "bench": ("kiln.bench.cli", "bench_group"),
    "profile": ("kiln.profile.cli", "profile_command"),
    "quantize": ("kiln.quant.cli", "quantize_cmd"),
}

@click.group(cls=LazyGroup, context_settings=HELP_OPTIONS)
@click.version_option(package_name="kiln")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """Kiln: make LLMs fast and serve them on NVIDIA GPUs."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")


@main.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="checkpoint directory, Hugging Face hub id, or zoo name")
@click.option("--prompt", help="text to continue, streamed as it is generated (-: read stdin)")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="prompts to run as one batch: one a line, or JSONL (-: read stdin)")
@click.option("--output", type=click.Path(dir_okay=False, allow_dash=True),
              help="write one JSON line per prompt, in input order (-: stdout)")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0: greedy")
@click.option("--top-p", default=1.0, show_default=True,
              type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1),
              help="0 or -1: off")
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option("--repetition-penalty", default=1.0, show_default=True,
              type=click.FloatRange(min=0.0, min_open=True), help="1: off")
@click.option("--presence-penalty", default=0.0, show_default=True,
              type=click.FloatRange(-2.0, 2.0))
@click.option("--frequency-penalty", default=0.0, show_default=True,
              type=click.FloatRange(-2.0, 2.0))
@click.option("--n", default=1, show_default=True, type=click.IntRange(min=1),
              help="samples per prompt (sampled: give --temperature > 0), each its own result")
@click.option("--stop", multiple=True,
              help="end the text where this string appears, leaving it out (repeatable)")
@click.option("--chat", is_flag=True,
              help="wrap each prompt in the model's chat template and show only the reply")
@click.option("--json-schema", metavar="FILE|JSON",
              help="structured output: text that follows this JSON schema (a file, or inline)")
@click.option("--json-object", is_flag=True, help="structured output: any JSON object")
@click.option("--regex", help="structured output: text the regular expression matches whole")
@click.option("--choice", multiple=True,
              help="structured output: exactly one of these strings (repeatable)")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False),
              help="structured output: text in this EBNF grammar file (start rule: root)")
@engine_options
def generate(model: str, prompt: str | None, prompts_file: str | None, output: str | None,
             chat: bool, json_schema: str | None, json_object: bool, regex: str | None,
             choice: tuple[str, ...], grammar: str | None, engine_kwargs: dict[str, Any],
             **sampling: Any) -> None:
    """Continue --prompt, streaming it, or run --prompts-file as one batch.

    A prompts file holds one prompt a line (blank lines skipped) or, when its first line starts
    with "{", JSONL: each line {"prompt": TEXT} or a chat {"messages": [{"role": ...,
    "content": ...}, ...]}, whose other keys (an id, a reference answer) are copied into its
    result.

    A batch goes into the engine at once (continuous batching). Its results print in input
    order or, with --output, are one JSON line per prompt: the prompt's keys, text, token_ids,
    finish_reason, stop_reason, num_prompt_tokens, and the seconds from the batch's start to
    its first token and to its end. The file is replaced only once every result is in. Every
    prompt is checked before any runs: if some cannot run (longer than the context, a chat the
    template rejects), each is named and none runs.

    --n N draws N samples of each prompt (printed once they are all done, even for --prompt):
    N result lines a prompt, told apart by sample_index (0 to N-1).

    --json-schema, --json-object, --regex, --choice or --grammar (one of them) constrains every
    output, as a server's structured outputs do; it is compiled once, before anything runs.

    --seed also seeds each request's sampling, so a sampled run repeats: prompt i (from 0) of a
    batch with --seed + i, so that duplicate prompts draw different samples (and the N samples
    of a prompt each their own stream of that seed).
    """
    from kiln.batch_io import PromptInput
    from kiln.engine.llm_engine import LLMEngine
    from kiln.llm import offline_options
    from kiln.sampling.params import SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give one of --prompt TEXT and --prompts-file PATH")
    if _same_file(output, prompts_file):
        raise click.BadParameter(f"{output} is also the --prompts-file: writing it would replace "
                                 "the prompts; choose another --output", param_hint="--output")
    if prompts_file is not None:
        inputs = _read_prompts(prompts_file)
    else:
        inputs = [PromptInput("--prompt", {"prompt": _read_stdin() if prompt == "-" else prompt})]
    stream = prompts_file is None and output is None and sampling["n"] == 1
    structured = _structured_outputs(json_schema, json_object, regex, choice, grammar)
    try:
        params = SamplingParams(**sampling, seed=engine_kwargs.get("seed"),
                                structured_outputs=structured)
        if output not in (None, "-"):  # (now, not once the batch has run)
            Path(output).parent.mkdir(parents=True, exist_ok=True)
        # a batch is an offline run: kiln.LLM's larger step on large GPUs
        engine = LLMEngine.from_kwargs(
            model, **(engine_kwargs if stream else offline_options(engine_kwargs)))
        template = _chat_template(engine.tokenizer, chat or any(i.messages for i in inputs))
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    if structured is not None:  # once here, not an error for each prompt
        try:
            engine.compile_grammar(structured)
        except ValueError as exc:
            flag = next(f for f, kind in STRUCTURED_FLAGS.items() if kind == structured.kind)
            raise click.BadParameter(str(exc), param_hint=flag) from None
    if stream:
        _stream(engine, inputs[0], params, chat, template)
    else:
        _run_batch(engine, inputs, params, chat, template, output)


# kiln generate's structured-output options -> StructuredOutputsParams' fields
STRUCTURED_FLAGS = {"--json-schema": "json", "--json-object": "json_object", "--regex": "regex",
                    "--choice": "choice", "--grammar": "grammar"}


def _structured_outputs(json_schema: str | None, json_object: bool, regex: str | None,
                        choice: tuple[str, ...], grammar: str | None
                        ) -> StructuredOutputsParams | None:
    """The one structured-output option given, as StructuredOutputsParams (None: none)."""
    from kiln.sampling.params import StructuredOutputsParams

    given = {"--json-schema": json_schema, "--json-object": json_object or None,
             "--regex": regex, "--choice": list(choice) or None, "--grammar": grammar}
    given = {flag: value for flag, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise click.UsageError(f"give one structured-output option, not {' and '.join(given)}")
    [(flag, value)] = given.items()
    try:
        if flag == "--json-schema":
            text = value if value.lstrip().startswith("{") else _read_text(value, flag)
            return StructuredOutputsParams(json=text)
        if flag == "--grammar":
            return StructuredOutputsParams(grammar=_read_text(value, flag))
        return StructuredOutputsParams(**{STRUCTURED_FLAGS[flag]: value})
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint=flag) from None


def _read_stdin() -> str:
    text = sys.stdin.read()
    if not text:
        raise click.ClickException("stdin is empty: --prompt - reads the prompt from it")
    return text


def _same_file(output: str | None, prompts_file: str | None) -> bool:
    if output in (None, "-") or prompts_file in (None, "-"):
        return False
    out = Path(output).resolve()  # (sub/.. is its parent even before mkdir makes sub)
    return out == Path(prompts_file).resolve() or out.exists() and out.samefile(prompts_file)


def _read_prompts(path: str) -> list[PromptInput]:
    from kiln.batch_io import read_prompts

    name = "<stdin>" if path == "-" else path
    try:
        # (utf-8-sig: the byte-order mark some editors write is not part of the first prompt)
        with click.open_file(path, encoding="utf-8-sig") as f:
            return read_prompts(f, name)
    except UnicodeDecodeError as exc:
        raise click.ClickException(f"{name} is not UTF-8 text ({exc})") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _chat_template(tokenizer: Any, needed: bool) -> str | None:
    if not needed:
        return None
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template: give prompts as text, without --chat")
    return template


def _stream(engine: LLMEngine, item: PromptInput, params: SamplingParams, chat: bool,
            template: str | None) -> None:
    try:
        engine.add_request("cli", item.engine_prompt(engine.tokenizer, chat, template), params)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(item.echo_text(chat), nl=False)
    printed = 0
    for out in engine.stream_outputs():
        done = out.outputs[0]
        click.echo(done.text[printed:], nl=False)
        printed = len(done.text)
        sys.stdout.flush()
    click.echo()
    if done.finish_reason == "length" and len(done.token_ids) < params.max_tokens:
        click.echo(f"(stopped at the model's context of {engine.max_model_len} tokens, "
                   f"{len(done.token_ids)} of --max-tokens {params.max_tokens} generated)",
                   err=True)


MAX_ERRORS_LISTED = 20  # of the prompts that cannot run: enough to show what is wrong


def _run_batch(engine: LLMEngine, inputs: list[PromptInput], params: SamplingParams,
               chat: bool, template: str | None, output: str | None) -> None:
    from kiln.progress import make_progress

    requests, errors = [], []
    for index, item in enumerate(inputs):
        own = params if params.seed is None else replace(params, seed=params.seed + index)
        try:
            requests.append(engine.make_request(
                str(index), item.engine_prompt(engine.tokenizer, chat, template), own,
                stream=False))
        except ValueError as exc:
            errors.append(f"{item.where}: {exc}")
    if errors:
        more = len(errors) - MAX_ERRORS_LISTED
        listed = "\n".join(errors[:MAX_ERRORS_LISTED]) + (f"\n...and {more} more" if more > 0
                                                          else "")
        raise click.ClickException(f"{len(errors)} of {len(inputs)} prompts cannot run, so none "
                                   f"ran:\n{listed}")
    start = time.monotonic()
    for request in requests:
        engine.enqueue(request)
    finished: dict[str, RequestOutput] = {}
    with make_progress() as progress:
        task = progress.add_task("generate", total=len(requests))
        for out in engine.stream_outputs():
            finished[out.request_id] = out
            progress.advance(task)
    results = [finished[str(i)] for i in range(len(inputs))]
    _emit(inputs, results, chat, output, start)
    samples = [done for out in results for done in out.outputs]
    cut = sum(done.finish_reason == "length" and len(done.token_ids) < params.max_tokens
              for done in samples)
    if cut:
        what = "prompts" if params.n == 1 else "samples"
        click.echo(f"({cut} of {len(samples)} {what} stopped at the model's context of "
                   f"{engine.max_model_len} tokens before --max-tokens {params.max_tokens})",
                   err=True)


def _emit(inputs: list[PromptInput], results: list[RequestOutput], chat: bool,
          output: str | None, start: float) -> None:
    """Print the results in input order, or write them as JSONL to --output (- : stdout)."""
    from kiln.batch_io import result_line, to_jsonl, write_atomically

    pairs = list(zip(inputs, results, strict=True))
    if output is None:
        for index, (item, out) in enumerate(pairs):
            many = len(out.outputs) > 1
            for done in out.outputs:
                if index or done.index:
                    click.echo()
                sample = f" [sample {done.index + 1} of {len(out.outputs)}]" if many else ""
                click.echo(f"==> {item.where}{sample} <==")
                click.echo(item.echo_text(chat) + done.text)
        return
    lines = [result_line(item, out, done, start) for item, out in pairs for done in out.outputs]
    text = to_jsonl(lines)
    if output == "-":
        click.echo(text, nl=False)
        return
    try:
        write_atomically(Path(output), text)
    except OSError as exc:
        raise click.ClickException(f"cannot write --output {output}: {exc}") from None
    click.echo(f"wrote {len(lines)} results to {output}", err=True)

if __name__ == "__main__":
    main()
