"""Evaluation: the blind win-tie-lose human study and automatic metrics (installed as ``attnqat.eval``)."""
