// routing_trace.cpp: placeholder.
