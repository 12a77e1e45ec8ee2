// test_expert_cache.cpp: placeholder.
