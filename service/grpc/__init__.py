"""The gRPC server: servicers for both contracts, conversions, interceptors, streaming, metrics."""
