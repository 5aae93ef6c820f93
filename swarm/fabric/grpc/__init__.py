"""grpc"""
