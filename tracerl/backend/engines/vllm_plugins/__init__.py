"""Files the vLLM server loads into its own process (``--tool-parser-plugin``): they import
vLLM, which the trainer's environment need not have, so nothing in tracerl imports them."""
