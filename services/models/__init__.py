"""Models to serve: the ones shipped as registry packages, any local GGUF file (converted
once into a served folder) or Hugging Face folder (``overture models``)."""
