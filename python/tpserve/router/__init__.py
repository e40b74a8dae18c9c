"""Data parallelism: which replica (an independent TP group) runs each request."""
