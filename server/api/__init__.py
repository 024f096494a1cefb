"""The HTTP layer: the FastAPI app, its middleware, the routers, the request and response schemas and the
demo page (static/)."""
