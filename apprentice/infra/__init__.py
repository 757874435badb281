"""Infrastructure: Docker sandboxes, the OpenAI-compatible server, Ray, the GPU path."""
