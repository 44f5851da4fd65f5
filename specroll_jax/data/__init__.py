"""Datasets shipped with the package (GSM8K, MIT licence: see ``gsm8k/LICENSE``)."""
