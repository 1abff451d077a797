"""The ``kiln`` command line: generate, serve, bench, profile, eval, quantize, zoo."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from kiln.cli_options import HELP_OPTIONS, engine_options
from kiln.zoo import DEFAULT_MODEL


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
@click.option("--prompt", required=True, help="text to continue")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0: greedy")
@click.option("--top-p", default=1.0, show_default=True,
              type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1),
              help="0 or -1: off")
@click.option("--chat", is_flag=True,
              help="wrap the prompt in the model's chat template and print only the reply")
@engine_options
def generate(model: str, prompt: str, max_tokens: int, temperature: float, top_p: float,
             top_k: int, chat: bool, engine_kwargs: dict[str, Any]) -> None:
    """Generate a continuation of PROMPT and stream it to the terminal.

    --seed also seeds this request's sampling here, so a sampled run repeats.
    """
    from kiln.engine.llm_engine import LLMEngine
    from kiln.sampling.params import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=engine_kwargs.get("seed"))
        engine = LLMEngine.from_kwargs(model, **engine_kwargs)
        if chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        engine.add_request("cli", prompt, params)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    if not chat:  # (the templated prompt is markup: a chat shows the reply alone)
        click.echo(prompt, nl=False)
    printed = 0
    for out in engine.stream_outputs():
        done = out.outputs[0]
        click.echo(done.text[printed:], nl=False)
        printed = len(done.text)
        sys.stdout.flush()
    click.echo()
    if done.finish_reason == "length" and len(done.token_ids) < max_tokens:
        click.echo(f"(stopped at the model's context of {engine.max_model_len} tokens, "
                   f"{len(done.token_ids)} of --max-tokens {max_tokens} generated)", err=True)


if __name__ == "__main__":
    main()
