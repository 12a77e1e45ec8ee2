// test_placement.cpp: placeholder.
