"""The REST API (``tocsin api``): native ``/v1`` routes, the go-scheduler facade, OpenAPI."""
