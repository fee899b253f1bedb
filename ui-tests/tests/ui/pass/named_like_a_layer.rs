// A struct of the user's may share a layer's name: `amp::nn::Linear` inside a `Linear` is not the
// struct holding itself (only a path of its own, `Linear` or `Self`, is).
use amp::AmpModule;

#[derive(AmpModule)]
struct Linear {
    inner: amp::nn::Linear,
    #[amp(skip)]
    tag: std::marker::PhantomData<Self>,
}

fn main() {
    assert_eq!(<Linear as AmpModule>::PLAN.type_name, "Linear");
}
