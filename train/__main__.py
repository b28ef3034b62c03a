"""python -m train [recipe=NAME] [key=value ...] [--dry-run] [--print-config]"""

from __future__ import annotations

import json
import logging
import sys

from recipes import RecipeError, available_recipes
from train.config import DEFAULT_RECIPE, load_recipe, to_yaml
from train.errors import NonFiniteLossError
from train.launch import local_rank_argument

USAGE = f"""usage: python -m train [recipe=NAME] [key=value ...] [--dry-run] [--print-config] [--prepare-data]

Retrofit a pretrained causal LM with learned KV-cache eviction gates (DMS or TRIM-KV).

  recipe=NAME      a recipe from recipes/ (default: {DEFAULT_RECIPE})
  key=value        override any recipe field, e.g. trainer.max_steps=20 gate.dms.window=32
  --dry-run        resolve and validate the recipe against the backbone's architecture, build the
                   strategy, and print what would run; loads no weights, downloads nothing
  --print-config   print the resolved config and exit
  --prepare-data   prepare the recipe's data into the cache and exit (once, before a multi-node run,
                   so no rank waits on it inside a collective's timeout)

recipes:
{{recipes}}
"""


def parse(argv: list[str]) -> tuple[str, list[str], set[str]]:
    argv = local_rank_argument(argv)  # DeepSpeed's launcher appends --local_rank=N
    flags = {a for a in argv if a.startswith("--")}
    unknown = flags - {"--dry-run", "--print-config", "--prepare-data", "--help"}
    if unknown:
        raise RecipeError(f"unknown option(s) {sorted(unknown)}; valid: --dry-run, --print-config, --prepare-data, --help")
    rest = [a for a in argv if not a.startswith("-")]
    recipes = [a.split("=", 1)[1] for a in rest if a.startswith("recipe=")]
    if len(recipes) > 1:
        raise RecipeError(f"recipe= given {len(recipes)} times; give it once")
    return (recipes[0] if recipes else DEFAULT_RECIPE), [a for a in rest if not a.startswith("recipe=")], flags


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE.format(recipes="\n".join(f"  {r}" for r in available_recipes())))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        name, overrides, flags = parse(argv)
        cfg = load_recipe(name, overrides)
        if "--print-config" in flags:
            print(to_yaml(cfg))
            return 0
        if "--dry-run" in flags:
            from train.run import dry_run

            print(json.dumps(dry_run(cfg), indent=2, default=str))
            print(f"dry run ok: recipe {name} is valid")
            return 0
        if "--prepare-data" in flags:
            from train.run import prepare_data

            print(json.dumps(prepare_data(cfg), indent=2))
            return 0
        from train.run import train

        summary = train(cfg)
    except (RecipeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
