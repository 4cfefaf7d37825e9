"""The upstream client: pooled keep-alive HTTP/1.1 connections to replicas."""
