"""The policy core of Sluice: admission, the coalescing window, ordering, grouping.

Pure Python in the style of h11: no asyncio, no vLLM, no clock of its own. The
server passes time in (`now`) and acts on what the core returns.
"""
