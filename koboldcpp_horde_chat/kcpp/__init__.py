"""koboldcpp's side: its client, request bodies, answers, SSE, the chat stream,
reasoning, local use, and the hook that runs the worker inside koboldcpp."""
