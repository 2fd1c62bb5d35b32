"""Where models live on disk: the default model's pull, the GGUF import and model discovery."""
