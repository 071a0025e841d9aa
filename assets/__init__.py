"""Data shipped with attnqat: the embedded tiny model, prompt lists, example media."""
