//! `AmpModule` for containers of modules: `Vec`, `Option`, `Box`, arrays. Elements are visited with
//! their index as path segment (`layers.3.fc.weight`), as candle-nn's `VarBuilder::pp` names them.

use super::{AmpModule, Cursor, HalfSafe, NoFp16Under, Plan, PlanNode, Request, Visitor, VisitorMut};

impl<T: AmpModule> AmpModule for Vec<T> {
    type Module = Vec<T::Module>;
    const PLAN: Plan =
        Plan { type_name: "Vec", node: PlanNode::Repeated { container: "Vec", item: &T::PLAN } };

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        self.as_slice().visit_items(cursor, visitor);
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        self.as_mut_slice().visit_items_mut(cursor, visitor);
    }
}

impl<T: AmpModule, const N: usize> AmpModule for [T; N] {
    type Module = [T::Module; N];
    const PLAN: Plan =
        Plan { type_name: "array", node: PlanNode::Repeated { container: "array", item: &T::PLAN } };

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        self.as_slice().visit_items(cursor, visitor);
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        self.as_mut_slice().visit_items_mut(cursor, visitor);
    }
}

impl<T: AmpModule> AmpModule for Option<T> {
    type Module = Option<T::Module>;
    const PLAN: Plan =
        Plan { type_name: "Option", node: PlanNode::Repeated { container: "Option", item: &T::PLAN } };

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        if let Some(inner) = self {
            inner.visit(cursor, visitor);
        }
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        if let Some(inner) = self {
            inner.visit_mut(cursor, visitor);
        }
    }
}

impl<T: AmpModule> AmpModule for Box<T> {
    type Module = Box<T::Module>;
    const PLAN: Plan = T::PLAN;

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        (**self).visit(cursor, visitor);
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        (**self).visit_mut(cursor, visitor);
    }
}

impl<R: Request, T: NoFp16Under<R>> NoFp16Under<R> for Vec<T> {}
impl<R: Request, T: NoFp16Under<R>, const N: usize> NoFp16Under<R> for [T; N] {}
impl<R: Request, T: NoFp16Under<R>> NoFp16Under<R> for Option<T> {}
impl<R: Request, T: NoFp16Under<R>> NoFp16Under<R> for Box<T> {}

impl<T: HalfSafe> HalfSafe for Vec<T> {}
impl<T: HalfSafe, const N: usize> HalfSafe for [T; N] {}
impl<T: HalfSafe> HalfSafe for Option<T> {}
impl<T: HalfSafe> HalfSafe for Box<T> {}

trait VisitItems {
    fn visit_items(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor);
    fn visit_items_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut);
}

impl<T: AmpModule> VisitItems for [T] {
    fn visit_items(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        for (index, item) in self.iter().enumerate() {
            cursor.push_index(index);
            item.visit(cursor, visitor);
            cursor.pop();
        }
    }

    fn visit_items_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        for (index, item) in self.iter_mut().enumerate() {
            cursor.push_index(index);
            item.visit_mut(cursor, visitor);
            cursor.pop();
        }
    }
}
