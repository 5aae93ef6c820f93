"""membership"""
