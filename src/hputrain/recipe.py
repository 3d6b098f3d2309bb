"""Moved to hputrain.recipes (one module per recipe); these names stay importable from here."""
from .recipes import RECIPE_DEFAULTS, RecipeOptions, add_train_parser, cmd_train, resolve_settings

__all__ = ["RECIPE_DEFAULTS", "RecipeOptions", "add_train_parser", "cmd_train", "resolve_settings"]
