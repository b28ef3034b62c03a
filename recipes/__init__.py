"""The recipe system both CLIs share: YAML recipes in this folder (training) and recipes/eval (evaluation),
merged onto a typed dataclass schema (OmegaConf structured config) with `key=value` overrides.

An unknown key or a wrongly typed value is caught at load time, naming the key, a close match and the valid
keys; each schema's own `validate` then rejects impossible values.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

RECIPES_DIR = Path(__file__).resolve().parent


class RecipeError(ValueError):
    """A recipe or override that cannot run, naming the bad key or value and the valid choices."""


def available_recipes(folder: Path = RECIPES_DIR) -> list[str]:
    """The recipe names in `folder` (training recipes by default; evaluation recipes live in recipes/eval)."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_structured(schema: type, folder: Path, name: str, overrides: list[str] | tuple[str, ...] = ()):
    """A dataclass `schema` <- folder/NAME.yaml <- `key=value` overrides (the recipe system of training and
    evaluation alike). The schema's `recipe` field is set to NAME."""
    recipes = available_recipes(folder)
    if name not in recipes:
        raise RecipeError(f"unknown recipe {name!r}; available recipes: {', '.join(recipes)}")
    merged = _merge(OmegaConf.structured(schema), _read_recipe(folder / f"{name}.yaml"), f"recipe {name}")
    merged.recipe = name
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. trainer.max_steps=10)")
        key = item.split("=", 1)[0]
        if key == "recipe":
            raise RecipeError("recipe= must come before the overrides and appear once")
        merged = _merge(merged, OmegaConf.from_dotlist([item]), f"override {item!r}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise RecipeError(f"recipe {name}: {_describe(err)}") from None


def _read_recipe(path: Path) -> DictConfig:
    """A recipe file's mapping of settings, or a RecipeError naming the file and what is wrong with it."""
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise RecipeError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(loaded, DictConfig):
        raise RecipeError(f"{path} holds a YAML list; a recipe is a mapping of settings (e.g. `optim: {{lr: 1e-4}}`)")
    if not loaded:
        raise RecipeError(f"{path} is empty; a recipe holds at least one setting")
    return loaded


def _merge(base: DictConfig, update: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = err.full_key or getattr(err, "key", "?")
        raise RecipeError(f"{origin}: unknown key {key!r}; {_valid_keys_hint(base, str(key))}") from None
    except ValidationError as err:
        raise RecipeError(f"{origin}: {_describe(err)}") from None


def _valid_keys_hint(config: DictConfig, key: str) -> str:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if isinstance(node, DictConfig) and part in node and isinstance(node[part], DictConfig):
            node = node[part]
        else:
            break
    valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(parts[-1], valid, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"valid keys here: {', '.join(valid)}"


def _describe(err: OmegaConfBaseException) -> str:
    text = str(err).splitlines()[0]
    key = getattr(err, "full_key", None)
    return f"key {key!r}: {text}" if key else text


def choice(value: Any, valid: tuple, what: str) -> None:
    if value not in valid:
        raise RecipeError(f"{what}={value!r} is invalid; valid: {', '.join(map(repr, valid))}")


