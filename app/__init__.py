"""The Gradio comparison app (installed as ``attnqat.app``)."""
