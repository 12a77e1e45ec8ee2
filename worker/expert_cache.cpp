// expert_cache.cpp: placeholder.
