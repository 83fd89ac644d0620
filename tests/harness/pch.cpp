// The translation unit that builds the tests' precompiled header (WEFT_PCH in
// the top CMakeLists.txt); the header itself is weft.hpp plus weft_test.hpp.
