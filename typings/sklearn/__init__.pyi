# The part of scikit-learn that monadl's examples use (it ships no type information).
