// test_routing_trace.cpp: placeholder.
